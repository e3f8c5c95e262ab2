"""Saved-activation ratio (AGoQ / bf16 baseline) on tiny and small, as tests/agoq/test_agoq_memory.py.
usage: ratio.py '{"logits": 4, ...}' [tiny,small]"""
import json
import sys
import time

import torch

from leantrain.agoq import Policy, quantize_activations
from leantrain.config import preset
from leantrain.runtime.ledger import SavedActivationMeter
from leantrain.model import Llama

kw = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
names = (sys.argv[2] if len(sys.argv) > 2 else "tiny,small").split(",")
for name in names:
    t0 = time.time()
    cfg = preset(name)
    cfg.model.vocab_size = cfg.data.tokenizer_vocab
    torch.manual_seed(0)
    m = Llama(cfg.model).to(torch.bfloat16)
    B, T = cfg.data.batch_size, cfg.data.seq_len
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)
    tgt = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)
    with SavedActivationMeter(m.parameters()) as base:
        loss = m(idx, tgt)
    del loss
    with SavedActivationMeter(m.parameters()) as meter:
        with quantize_activations(m, Policy(**kw)) as pk:
            loss = m(idx, tgt)
    del loss
    br = {r: round(v / base.bytes, 4) for r, v in sorted(meter.by_role.items())}
    print(json.dumps({"preset": name, "policy": kw, "baseline": base.bytes, "agoq": meter.bytes,
                      "ratio": round(meter.bytes / base.bytes, 4), "by_role_frac": br,
                      "base_by_role": {r: round(v / base.bytes, 4) for r, v in sorted(base.by_role.items())},
                      "s": round(time.time() - t0, 1)}), flush=True)
