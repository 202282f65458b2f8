from models.llama3.args import Llama3Args, llama3_flavors
from models.llama3.model import Attention, Llama3, TransformerBlock

__all__ = ["Attention", "Llama3", "Llama3Args", "TransformerBlock", "llama3_flavors"]
