"""Real architectures built from attnkit's modules: a BERT-style encoder that loads real weights,
and a GPT-2-style decoder with KV-cache generation.

Importing this package imports neither ``safetensors`` nor ``tokenizers``; the loaders do.
"""

from attnkit.models.bert import (
    BertConfig,
    BertEmbeddings,
    BertEncoder,
    EncodedBatch,
    encode,
    hf_bert_state_dict,
    load_bert,
    load_minilm,
    load_tokenizer,
    mean_pool,
)
from attnkit.models.gpt import GPT, GPTConfig

__all__ = [
    "GPT",
    "BertConfig",
    "BertEmbeddings",
    "BertEncoder",
    "EncodedBatch",
    "GPTConfig",
    "encode",
    "hf_bert_state_dict",
    "load_bert",
    "load_minilm",
    "load_tokenizer",
    "mean_pool",
]
