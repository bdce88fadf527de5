"""Flax linen models: MLP, ViT, char-level GPT, BERT (MiniLM loader), a transformer with
FP8-simulated attention logits (P14), and the decoder LLM family (Llama-3, Qwen2, Gemma-2/3) with
Hugging Face checkpoint loading and saving, and its FSDP / tensor-parallel partition rules.

Every projection is a plain `nn.Dense` with a 2-D kernel (in, out), so adapter rules over
'/'-joined parameter paths (e.g. `.*attention/(query|value)/kernel`) see one matrix per projection.
"""

from lowrank_jax.models.bert import BertClassifier as BertClassifier
from lowrank_jax.models.bert import BertConfig as BertConfig
from lowrank_jax.models.bert import BertEncoder as BertEncoder
from lowrank_jax.models.bert import BertTopClassifier as BertTopClassifier
from lowrank_jax.models.bert import attention_inputs as bert_attention_inputs
from lowrank_jax.models.bert import classifier_variables as classifier_variables
from lowrank_jax.models.bert import mean_pool as mean_pool
from lowrank_jax.models.bert import sentence_embedding as sentence_embedding
from lowrank_jax.models.bert import split_encoder as split_encoder
from lowrank_jax.models.bert_prefix import encode_prefix as encode_prefix
from lowrank_jax.models.bert_prefix import prefix_encoder as prefix_encoder
from lowrank_jax.models.cnn import CNN as CNN
from lowrank_jax.models.decoder import DecoderLM as DecoderLM
from lowrank_jax.models.decoder import KVCache as KVCache
from lowrank_jax.models.decoder import init_cache as init_cache
from lowrank_jax.models.decoder_config import DecoderConfig as DecoderConfig
from lowrank_jax.models.decoder_config import RopeConfig as RopeConfig
from lowrank_jax.models.decoder_config import rope_frequencies as rope_frequencies
from lowrank_jax.models.decoder_sharding import (
    decoder_partition_rules as decoder_partition_rules,
)
from lowrank_jax.models.decoder_sharding import (
    decoder_partition_specs as decoder_partition_specs,
)
from lowrank_jax.models.fp8_transformer import Fp8SelfAttention as Fp8SelfAttention
from lowrank_jax.models.fp8_transformer import Fp8Transformer as Fp8Transformer
from lowrank_jax.models.fp8_transformer import fp8_attention_geometry as fp8_attention_geometry
from lowrank_jax.models.gpt import CharGPT as CharGPT
from lowrank_jax.models.hf_bert import convert_bert_weights as convert_bert_weights
from lowrank_jax.models.hf_bert import flax_path_from_peft as flax_path_from_peft
from lowrank_jax.models.hf_bert import peft_module_name as peft_module_name
from lowrank_jax.models.hf_decoder import hf_module_name as hf_module_name
from lowrank_jax.models.hf_decoder import load_hf_decoder as load_hf_decoder
from lowrank_jax.models.hf_decoder import path_from_hf_module as path_from_hf_module
from lowrank_jax.models.hf_decoder import save_hf_decoder as save_hf_decoder
from lowrank_jax.models.hf_decoder_config import config_from_hf as config_from_hf
from lowrank_jax.models.hf_decoder_config import config_to_hf as config_to_hf
from lowrank_jax.models.layers import FeedForward as FeedForward
from lowrank_jax.models.layers import PreLNBlock as PreLNBlock
from lowrank_jax.models.layers import SelfAttention as SelfAttention
from lowrank_jax.models.layers import TransformerStack as TransformerStack
from lowrank_jax.models.layers import stack_layers as stack_layers
from lowrank_jax.models.layers import unstack_layers as unstack_layers
from lowrank_jax.models.minilm import MINILM_NAME as MINILM_NAME
from lowrank_jax.models.minilm import load_minilm as load_minilm
from lowrank_jax.models.minilm import minilm_dir as minilm_dir
from lowrank_jax.models.minilm import tokenize as tokenize
from lowrank_jax.models.mlp import MLP as MLP
from lowrank_jax.models.sampling import generate as generate
from lowrank_jax.models.vit import ViT as ViT

__all__ = [
    "MINILM_NAME",
    "CNN",
    "MLP",
    "BertClassifier",
    "BertConfig",
    "BertEncoder",
    "BertTopClassifier",
    "CharGPT",
    "DecoderConfig",
    "DecoderLM",
    "FeedForward",
    "KVCache",
    "Fp8SelfAttention",
    "Fp8Transformer",
    "PreLNBlock",
    "RopeConfig",
    "SelfAttention",
    "TransformerStack",
    "ViT",
    "bert_attention_inputs",
    "classifier_variables",
    "config_from_hf",
    "config_to_hf",
    "convert_bert_weights",
    "encode_prefix",
    "decoder_partition_rules",
    "decoder_partition_specs",
    "flax_path_from_peft",
    "fp8_attention_geometry",
    "generate",
    "hf_module_name",
    "init_cache",
    "load_hf_decoder",
    "load_minilm",
    "mean_pool",
    "minilm_dir",
    "path_from_hf_module",
    "peft_module_name",
    "prefix_encoder",
    "rope_frequencies",
    "save_hf_decoder",
    "sentence_embedding",
    "split_encoder",
    "stack_layers",
    "tokenize",
    "unstack_layers",
]
