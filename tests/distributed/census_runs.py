"""``python tests/distributed/census_runs.py ARGVS_JSON``: :func:`tools.planner.measure.census_of_runs`
of the given train.py argument lists, one JSON line of censuses on stdout. Run by
test_planner_compute.py on a process forked from tools/launcher.py's server (``run_train``), which
has torch and the trainer imported already."""

import json
import sys

from tools.planner.measure import census_of_runs

if __name__ == "__main__":
    print(json.dumps(census_of_runs(json.loads(sys.argv[1]))))
