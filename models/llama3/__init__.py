from models.llama3.args import Llama3Args, llama3_flavors
from models.llama3.model import Llama3, TransformerBlock

__all__ = ["Llama3", "Llama3Args", "TransformerBlock", "llama3_flavors"]
