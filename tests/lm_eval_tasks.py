"""Local lm-eval tasks for the tests of trainer/inference/lm_eval_*.py (no hub): task YAMLs over
JSONL files written into a folder, the way a user points lm-eval at local data
(``dataset_path: json`` + ``dataset_kwargs.data_files``).

* ``meshtrain_mc``: multiple choice (``acc``, ``acc_norm``), 6 documents of 3-4 choices;
* ``meshtrain_gen``: generate_until (``exact_match``), 4 documents, until ``"\\n"`` and ``"."``,
  8 new tokens at most;
* ``meshtrain_rolling``: loglikelihood_rolling (word / byte perplexity), 3 documents long enough
  for several windows when the context is short.
"""

from __future__ import annotations

import json
import os

MC_DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five", "seven", "nine"], "answer": 0},
    {"question": "Water freezes when it is", "choices": ["cold", "hot", "dry"], "answer": 0},
    {"question": "A cat says", "choices": ["meow", "woof", "moo"], "answer": 0},
    {"question": "The opposite of up is ", "choices": ["down", "left", "in"], "answer": 0},
    {"question": "Fire is", "choices": ["hot", "wet", "square", "quiet"], "answer": 0},
]
GEN_DOCS = [
    {"question": "What colour is the sky?", "answer": "blue"},
    {"question": "What is two plus two?", "answer": "four"},
    {"question": "Name a farm animal.", "answer": "cow"},
    {"question": "What do bees make?", "answer": "honey"},
]
ROLLING_DOCS = [
    {"text": "The quick brown fox jumps over the lazy dog. " * 3},
    {"text": "Once upon a time there was a little model that learned to count: one, two, three, four."},
    {"text": "Rain falls."},
]

TASKS = {
    "meshtrain_mc": """task: meshtrain_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: @DATA@
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}
""",
    "meshtrain_gen": """task: meshtrain_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: @DATA@
test_split: test
output_type: generate_until
doc_to_text: "Q: {{question}}\\nA:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true}
""",
    "meshtrain_rolling": """task: meshtrain_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: @DATA@
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
  - {metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}
""",
}
DOCS = {"meshtrain_mc": MC_DOCS, "meshtrain_gen": GEN_DOCS, "meshtrain_rolling": ROLLING_DOCS}


def write_tasks(folder) -> str:
    """The three tasks' YAMLs and data in ``folder`` (absolute data paths); returns ``folder``,
    lm-eval's ``include_path``."""
    os.makedirs(folder, exist_ok=True)
    for name, template in TASKS.items():
        data = os.path.join(str(folder), f"{name}.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(doc) + "\n" for doc in DOCS[name])
        with open(os.path.join(str(folder), f"{name}.yaml"), "w") as f:
            f.write(template.replace("@DATA@", data))
    return str(folder)


def offline_env() -> dict[str, str]:
    """What keeps lm-eval and datasets off the network (and their caches in the test's folder is
    the caller's choice)."""
    return {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
