from models.deepseek_v3.args import DeepSeekV3Args, deepseek_v3_flavors
from models.deepseek_v3.model import Attention, DeepSeekV3, TransformerBlock

__all__ = ["Attention", "DeepSeekV3", "DeepSeekV3Args", "TransformerBlock", "deepseek_v3_flavors"]
