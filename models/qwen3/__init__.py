from models.qwen3.args import Qwen3Args, qwen3_flavors
from models.qwen3.model import Attention, Qwen3, TransformerBlock

__all__ = ["Attention", "Qwen3", "Qwen3Args", "TransformerBlock", "qwen3_flavors"]
