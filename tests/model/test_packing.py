"""Packed sequences: documents packed in one row behave as if each were run alone.

Tolerance: fp32 logits of magnitude ~1; the packed forward masks the other documents' scores
(exp(-inf) = 0 exactly) and sums the same terms as the lone forward in another order: atol 1e-5,
rtol 1e-5. Gradients that must be zero are exactly zero."""

import dataclasses

import pytest
import torch

from leantrain.config import ModelConfig
from leantrain.model import Llama
from leantrain.model.llama import Packed, document_mask, document_positions

ATOL, RTOL = 1e-5, 1e-5
CFG = ModelConfig(vocab_size=101, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)


def _model(**options) -> Llama:
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(CFG, **options)).eval()
    with torch.no_grad():  # (norm weights away from 1, so that every parameter matters)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _packed(lengths_per_row: list[list[int]], seed: int = 1):
    """Random tokens in rows of packed documents: (tokens, document ids, [(row, start, end)])."""
    g = torch.Generator().manual_seed(seed)
    T = max(sum(r) for r in lengths_per_row)
    tokens = torch.randint(0, CFG.vocab_size, (len(lengths_per_row), T), generator=g)
    doc_ids = torch.full((len(lengths_per_row), T), -1)
    spans = []
    for b, lengths in enumerate(lengths_per_row):
        start = 0
        for d, n in enumerate(lengths):
            doc_ids[b, start:start + n] = d
            spans.append((b, start, start + n))
            start += n
        doc_ids[b, start:] = len(lengths)  # (padding: a document of its own)
    return tokens, doc_ids, spans


def test_positions_and_mask_of_documents():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0]]
    mask = document_mask(ids)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False]
    assert mask[2].tolist() == [True, True, True, False, False, False]


@pytest.mark.parametrize("options", [{}, {"fused_rope": False, "fused_proj": False}, {"n_kv_heads": 4},
                                     {"sdpa_gqa": False}])
def test_packed_logits_equal_each_document_alone(options):
    model = _model(**options)
    tokens, doc_ids, spans = _packed([[5, 9, 7], [13, 1, 6]])
    with torch.no_grad():
        packed = model(tokens, document_ids=doc_ids)
        assert torch.equal(packed, model(Packed(tokens, doc_ids)))
        for b, start, end in spans:
            alone = model(tokens[b:b + 1, start:end])[0]
            torch.testing.assert_close(packed[b, start:end], alone, atol=ATOL, rtol=RTOL)


def test_packed_loss_equals_the_documents_losses():
    model = _model()
    tokens, doc_ids, spans = _packed([[6, 10, 5]])
    targets = torch.roll(tokens, -1, dims=1)
    targets[0, [5, 15, 20]] = -100  # (each document's last token predicts nothing)
    total, count = 0.0, 0
    for _, start, end in spans:
        loss = model(tokens[:, start:end], targets[:, start:end])
        n = int((targets[:, start:end] != -100).sum())
        total, count = total + loss.item() * n, count + n
    with torch.no_grad():
        packed = model(tokens, targets, document_ids=doc_ids).item()
    assert packed == pytest.approx(total / count, rel=1e-5)


def _grads_at(model, tokens, targets, doc_ids, module):
    """The gradient of the loss with respect to ``module``'s output."""
    out_holder = []

    def keep(m, a, out):
        out.retain_grad()
        out_holder.append(out)

    handle = module.register_forward_hook(keep)
    try:
        model(tokens, targets, document_ids=doc_ids).backward()
    finally:
        handle.remove()
    return out_holder[0].grad


@pytest.mark.parametrize("fused_loss", [True, False])
def test_masked_targets_and_other_documents_get_no_gradient(fused_loss):
    model = _model(fused_loss=fused_loss).train()
    tokens, doc_ids, _ = _packed([[8, 8, 6]])
    targets = torch.roll(tokens, -1, dims=1)
    masked = torch.zeros_like(targets, dtype=torch.bool)
    masked[0, 3:8] = True  # (a prompt's positions: no loss)
    masked[0, 8:] = True  # (the later documents: no loss)
    targets[masked] = -100
    # the final hidden state of a masked position feeds only its own (masked) prediction: zero gradient
    grad_h = _grads_at(model, tokens, targets, doc_ids, model.norm)
    assert torch.count_nonzero(grad_h[masked]) == 0
    assert torch.count_nonzero(grad_h[~masked]) > 0
    # the later documents' embeddings do not reach the first document's loss: zero gradient
    model.zero_grad()
    grad_x = _grads_at(model, tokens, targets, doc_ids, model.embed_tokens)
    assert torch.count_nonzero(grad_x[0, 8:]) == 0 and torch.count_nonzero(grad_x[0, :8]) > 0


def test_one_document_per_row_is_the_unpacked_forward():
    model = _model()
    tokens, doc_ids, _ = _packed([[20], [20]])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, document_ids=doc_ids), model(tokens), atol=ATOL, rtol=RTOL)
