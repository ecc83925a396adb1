"""Real architectures built from attnkit's modules: a BERT-style encoder that loads real weights.

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

__all__ = [
    "BertConfig",
    "BertEmbeddings",
    "BertEncoder",
    "EncodedBatch",
    "encode",
    "hf_bert_state_dict",
    "load_bert",
    "load_minilm",
    "load_tokenizer",
    "mean_pool",
]
