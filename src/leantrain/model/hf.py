"""Hugging Face model directories in and out of leantrain.

Reading (:func:`load_hf`, :func:`from_pretrained`; ``hf_import.py``)::

    cfg, state, tok = load_hf("path/to/hf_dir")   # ModelConfig, state dict, HFTokenizer or None
    model = Llama(cfg); model.load_state_dict(state)
    model = from_pretrained("path/to/hf_dir", max_seq_len=2048)   # the same in one call

Writing (:func:`save_hf`, :func:`save_hf_state`; ``hf_export.py``)::

    save_hf(model, "out_dir", tokenizer=tok)                    # a Llama
    save_hf_state(cfg, state, "out_dir", tokenizer="run/tokenizer.json")   # a checkpoint's weights

What is mapped. ``config.json`` of ``model_type`` llama, mistral, qwen2 or qwen3 becomes a
:class:`leantrain.config.ModelConfig`: sizes, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling``
(or transformers 5's ``rope_parameters``) of type default, linear or llama3, ``head_dim``,
``tie_word_embeddings``, Qwen2's q/k/v biases (``attention_bias``), Qwen3's per-head q/k
RMSNorm (``qk_norm``), and the sliding window (Mistral's ``sliding_window``; Qwen's when
``use_sliding_window`` or ``layer_types`` turns it on), stored: leantrain attends over the whole
causal prefix, the same as the window up to its length, and refuses longer sequences. Weights:
``model.safetensors`` or ``model.safetensors.index.json`` and its shards, read with
``safetensors`` (pickled ``.bin`` files are never read); ``model.layers.N.self_attn.{q,k,v}_proj``
are stacked by rows into ``layers.N.self_attn.qkv_proj`` ([q; k; v], biases alike),
``mlp.{gate,up}_proj`` into ``mlp.gate_up_proj`` ([gate; up]), the ``model.`` prefix dropped;
a tied ``lm_head.weight`` equal to the embeddings is dropped, and the RoPE buffers older
checkpoints saved (``rotary_emb.inv_freq``) are recomputed from the config. Tokenizer:
``tokenizer.json`` through the ``tokenizers`` library, bos / eos / pad ids from
``tokenizer_config.json`` (else ``generation_config.json``, else ``config.json``), and the chat
template (``tokenizer_config.json`` or ``chat_template.jinja``), as an :class:`HFTokenizer`.

What is refused, with one sentence naming it (:class:`leantrain.config.ConfigError`): another
``model_type``; ``hidden_act`` other than silu; ``mlp_bias``; ``attention_bias`` in a llama,
mistral or qwen3 model (it biases ``o_proj`` too); ``attention_dropout`` > 0 (leantrain's attention
has no dropout: training would differ, so it is refused rather than ignored; set it to 0.0 in
``config.json`` to train without it); ``use_mrope``; a ``rope_scaling`` of another type or with
another key; a ``layer_types`` entry other than full / sliding attention; any config field not
known to leave the function unchanged (bookkeeping such as ``architectures``, token ids,
``use_cache``, ``initializer_range``, ``pretraining_tp`` is read and ignored); a tensor that maps
to nothing, a missing tensor or one of the wrong shape, by its Hugging Face name; a missing shard;
a directory with no ``config.json`` or no safetensors weights.

What is written. HF names with the projections split, ``config.json`` of the model_type that
computes the same function (qwen3 with ``qk_norm``, qwen2 with ``attention_bias``, mistral with a
``sliding_window``, llama otherwise: leantrain's own models export as llama), no
``lm_head.weight`` when the embeddings are tied, ``generation_config.json``, ``tokenizer.json`` and
``tokenizer_config.json`` (with the chat template) when a tokenizer is given, one
``model.safetensors`` or shards of at most ``max_shard_bytes`` (5 GiB) with
``model.safetensors.index.json``. ``transformers.AutoModelForCausalLM.from_pretrained`` loads it
with no missing or unexpected keys and the same logits (tests/model/test_hf.py).
"""

from leantrain.model.hf_export import config_to_hf, hf_model_type, hf_state, save_hf, save_hf_state
from leantrain.model.hf_import import (
    MODEL_TYPES,
    HFTokenizer,
    config_from_hf,
    from_pretrained,
    load_hf,
    load_hf_state,
    load_tokenizer,
)

__all__ = ["MODEL_TYPES", "HFTokenizer", "config_from_hf", "config_to_hf", "from_pretrained", "hf_model_type",
           "hf_state", "load_hf", "load_hf_state", "load_tokenizer", "save_hf", "save_hf_state"]
