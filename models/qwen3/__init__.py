from models.qwen3.args import Qwen3Args, qwen3_flavors
from models.qwen3.model import Qwen3, TransformerBlock

__all__ = ["Qwen3", "Qwen3Args", "TransformerBlock", "qwen3_flavors"]
