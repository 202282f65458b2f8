from models.common.decoder import moe_layers
from models.deepseek_v3.args import DeepSeekV3Args, deepseek_v3_flavors
from models.deepseek_v3.experts import GroupedExperts
from models.deepseek_v3.model import Attention, DeepSeekV3, TransformerBlock
from models.deepseek_v3.moe import MoE, TokenChoiceRouter

__all__ = [
    "Attention",
    "DeepSeekV3",
    "DeepSeekV3Args",
    "GroupedExperts",
    "MoE",
    "TokenChoiceRouter",
    "TransformerBlock",
    "deepseek_v3_flavors",
    "moe_layers",
]
