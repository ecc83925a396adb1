"""Real architectures built from attnkit's modules: a BERT-style encoder that loads real weights,
and a GPT-2-style decoder with KV-cache generation.

- :mod:`~attnkit.models.bert`: the encoder (:class:`BertEncoder`) and :func:`mean_pool`.
- :mod:`~attnkit.models.bert_io`: its weights and tokenizer (:func:`load_bert`,
  :func:`load_minilm`, :func:`encode`).
- :mod:`~attnkit.models.gpt`: the decoder (:class:`GPT`) and its generation.
- :mod:`~attnkit.models.token_ids`: the ``input_ids`` check both models share.

Importing this package imports neither ``safetensors`` nor ``tokenizers``; the loaders do.
"""

from attnkit.models.bert import BertConfig, BertEmbeddings, BertEncoder, mean_pool
from attnkit.models.bert_io import (
    EncodedBatch,
    encode,
    hf_bert_state_dict,
    load_bert,
    load_minilm,
    load_tokenizer,
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
