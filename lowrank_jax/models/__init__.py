"""Flax linen models: MLP, ViT, char-level GPT, BERT (MiniLM loader), a transformer with
FP8-simulated attention logits (P14), and the decoder LLM family (Llama-3, Qwen2, Gemma-2/3) with
Hugging Face checkpoint loading and saving, and its FSDP / tensor-parallel partition rules.

Every projection is a plain `nn.Dense` with a 2-D kernel (in, out), so adapter rules over
'/'-joined parameter paths (e.g. `.*attention/(query|value)/kernel`) see one matrix per projection.
"""

from lowrank_jax.models.bert import BertClassifier as BertClassifier
from lowrank_jax.models.bert import BertConfig as BertConfig
from lowrank_jax.models.bert import BertEncoder as BertEncoder
from lowrank_jax.models.bert import classifier_variables as classifier_variables
from lowrank_jax.models.bert import mean_pool as mean_pool
from lowrank_jax.models.cnn import CNN as CNN
from lowrank_jax.models.decoder import DecoderLM as DecoderLM
from lowrank_jax.models.decoder_config import DecoderConfig as DecoderConfig
from lowrank_jax.models.decoder_sharding import decoder_partition_specs as decoder_partition_specs
from lowrank_jax.models.fp8_transformer import Fp8Transformer as Fp8Transformer
from lowrank_jax.models.gpt import CharGPT as CharGPT
from lowrank_jax.models.hf_bert import flax_path_from_peft as flax_path_from_peft
from lowrank_jax.models.hf_bert import peft_module_name as peft_module_name
from lowrank_jax.models.hf_decoder import hf_module_name as hf_module_name
from lowrank_jax.models.hf_decoder import load_hf_decoder as load_hf_decoder
from lowrank_jax.models.hf_decoder import path_from_hf_module as path_from_hf_module
from lowrank_jax.models.hf_decoder import save_hf_decoder as save_hf_decoder
from lowrank_jax.models.minilm import MINILM_NAME as MINILM_NAME
from lowrank_jax.models.minilm import load_minilm as load_minilm
from lowrank_jax.models.minilm import minilm_dir as minilm_dir
from lowrank_jax.models.minilm import tokenize as tokenize
from lowrank_jax.models.mlp import MLP as MLP
from lowrank_jax.models.sampling import generate as generate
from lowrank_jax.models.vit import ViT as ViT

__all__ = [
    "CNN",
    "MINILM_NAME",
    "MLP",
    "BertClassifier",
    "BertConfig",
    "BertEncoder",
    "CharGPT",
    "DecoderConfig",
    "DecoderLM",
    "Fp8Transformer",
    "ViT",
    "classifier_variables",
    "decoder_partition_specs",
    "flax_path_from_peft",
    "generate",
    "hf_module_name",
    "load_hf_decoder",
    "load_minilm",
    "mean_pool",
    "minilm_dir",
    "path_from_hf_module",
    "peft_module_name",
    "save_hf_decoder",
    "tokenize",
]
