"""Flax linen models: MLP, ViT (Hugging Face ViT checkpoints), char-level GPT, BERT (MiniLM loader), a transformer with
FP8-simulated attention logits (P14), and the decoder LLM family (Llama-3, Qwen2, Gemma-2/3) with
Hugging Face checkpoint loading and saving, and its FSDP / tensor-parallel partition rules.

Every projection is a plain `nn.Dense` with a 2-D kernel (in, out), so adapter rules over
'/'-joined parameter paths (e.g. `.*attention/(query|value)/kernel`) see one matrix per projection.
"""

from lowrank_jax.models.bert import (
    BertClassifier,
    BertConfig,
    BertEncoder,
    classifier_variables,
    mean_pool,
)
from lowrank_jax.models.cnn import CNN
from lowrank_jax.models.decoder import DecoderLM
from lowrank_jax.models.decoder_config import DecoderConfig
from lowrank_jax.models.decoder_sharding import decoder_partition_specs
from lowrank_jax.models.fp8_transformer import Fp8Transformer
from lowrank_jax.models.gpt import CharGPT
from lowrank_jax.models.hf_bert import bert_module_name, bert_path_from_module
from lowrank_jax.models.hf_decoder import (
    decoder_module_name,
    decoder_path_from_module,
    load_hf_decoder,
    save_hf_decoder,
)
from lowrank_jax.models.hf_decoder_config import config_from_hf
from lowrank_jax.models.hf_vit import load_hf_vit
from lowrank_jax.models.minilm import MINILM_NAME, load_minilm, minilm_dir, tokenize
from lowrank_jax.models.mlp import MLP
from lowrank_jax.models.sampling import generate
from lowrank_jax.models.vit import ViT

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
    "bert_module_name",
    "bert_path_from_module",
    "classifier_variables",
    "config_from_hf",
    "decoder_module_name",
    "decoder_partition_specs",
    "decoder_path_from_module",
    "generate",
    "load_hf_decoder",
    "load_hf_vit",
    "load_minilm",
    "mean_pool",
    "minilm_dir",
    "save_hf_decoder",
    "tokenize",
]
