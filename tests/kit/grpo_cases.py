"""GRPO, GSPO and CISPO on one synthetic global batch: the batch, the float64 reference of every key, each
rank's feed (the last stage's shard, in several microbatch splits) and the collectives ``accumulate`` may issue.

Shared by the GRPO tests and the tests of metrics that share GRPO's terms (``tests/test_token_sums.py``).
"""

from __future__ import annotations

import math

import torch

from kit.references import full_vocab_stats
from twinkle_megatron.testing.batches import RankView, split_microbatches
from twinkle_megatron.testing.distributed import Layout
from twinkle_megatron.testing.invariance import Call

BATCH, SEQ, VOCAB, PADDED_VOCAB = 8, 12, 50, 56
EPSILON, EPSILON_HIGH, TOP_K = 0.2, 0.28, 5


def global_batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, SEQ, PADDED_VOCAB, generator=generator) * 2
    logits[..., VOCAB:] = 30.0  # padding columns would dominate the entropy if they were read
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    prompt = torch.randint(1, 5, (BATCH, 1), generator=generator)
    labels[torch.arange(SEQ)[None, :] < prompt] = -100
    labels[torch.rand(BATCH, SEQ, generator=generator) < 0.15] = -100
    labels[5] = -100  # a fully masked sequence
    mask = labels != -100
    stats = full_vocab_stats(logits, labels, VOCAB)
    logps = stats.logprobs.float()
    old = logps + 0.3 * torch.randn(BATCH, SEQ, generator=generator) + 0.3 * torch.randn(BATCH, 1, generator=generator)
    return {"logits": logits, "labels": labels, "logps": logps, "old": torch.where(mask, old, 0.0),
            "entropies": stats.entropy.float(), "reference_entropy": stats.entropy,
            "advantages": torch.randn(BATCH, generator=generator)}


def reference(name: str) -> dict:
    batch = global_batch()
    mask = batch["labels"] != -100
    new, old = batch["logps"].double(), batch["old"].double()
    d = new - old
    ratio, kl = d.exp(), d.exp() - d - 1
    advantage = batch["advantages"].double()[:, None].expand(BATCH, SEQ)
    result = {
        "train/policy_confidence": math.exp(new[mask].mean()),
        "train/mean_new_logp": float(new[mask].mean()),
        "train/mean_old_logp": float(old[mask].mean()),
        "train/logp_diff_mean": float(d[mask].mean()),
        "train/approx_kl": float(kl[mask].mean()),
        "train/token_kl_max": float(kl[mask].max()),
        "train/token_ratio_max": float(ratio[mask].max()),
        "train/entropy": float(batch["reference_entropy"][mask].mean()),
    }
    if name == "gspo":
        tokens = mask.sum(-1)
        sequence_ratio = ((d * mask).sum(-1) / tokens.clamp(min=1)).exp()
        counted, sign = tokens > 0, batch["advantages"]
        low = (counted & (sequence_ratio < 1 - EPSILON) & (sign < 0)).sum() / counted.sum()
        high = (counted & (sequence_ratio > 1 + EPSILON_HIGH) & (sign > 0)).sum() / counted.sum()
    else:
        gate_low = advantage < 0 if name == "grpo" else True
        gate_high = advantage > 0 if name == "grpo" else True
        low = (mask & (ratio < 1 - EPSILON) & gate_low).sum() / mask.sum()
        high = (mask & (ratio > 1 + EPSILON_HIGH) & gate_high).sum() / mask.sum()
    result.update({"train/clip_ratio_low": float(low), "train/clip_ratio_high": float(high),
                   "train/clip_ratio": float(low + high)})
    order = sorted(((float(kl[i, j]), i, j) for i, j in mask.nonzero().tolist()), key=lambda t: (-t[0], t[1], t[2]))
    result["_high_kl_records"] = [
        {"gsi": i, "pos": j, "token_id": int(batch["labels"][i, j]), "kl": k, "ratio": float(ratio[i, j]),
         "logp_new": float(new[i, j]), "logp_old": float(old[i, j])} for k, i, j in order[:TOP_K]]
    return result


def _per_microbatch(tensor: torch.Tensor, count: int, as_list: bool):
    return split_microbatches(tensor, count) if as_list else tensor


def feed_last_stage(metric, batch: dict, view: RankView, variant: tuple) -> list[Call]:
    """This rank's shard, for one metric and microbatch split (``variant``: name, count, as_list)."""
    name, count, as_list = variant
    if not view.last_stage:
        return []
    local = {k: view.tokens(v) for k, v in batch.items() if v.dim() > 1}
    inputs = [{"labels": labels} for labels in split_microbatches(local["labels"], count)]
    mask = local["labels"] != -100
    # Whole sequences: Twinkle's ragged lists; CP chunks: tensors shaped like the local logps.
    old = _per_microbatch(local["old"], count, as_list) if view.cp_size > 1 else \
        [row[row_mask].tolist() for row, row_mask in zip(local["old"], mask)]
    outputs = {"logps": _per_microbatch(local["logps"], count, as_list)}
    if name == "grpo":  # GRPO reads the entropy from this rank's vocab shard; the others get it precomputed
        outputs["logits"] = _per_microbatch(view.vocab(local["logits"]), count, as_list)
    else:
        outputs["entropies"] = _per_microbatch(local["entropies"], count, as_list)
    return [Call(inputs, outputs, {"old_logps": old, "advantages": view.rows(batch["advantages"]).tolist()})]


def accumulate_collectives(layout: Layout, variant: tuple) -> dict:
    """TP entropy for GRPO (two per microbatch), the CP sum of GSPO's per-sequence partials (one per
    microbatch), nothing else; whole tensors: one concatenated pass."""
    name, count, as_list = variant
    passes = count if as_list else 1
    if name == "grpo" and layout.tp > 1:
        return {"all_reduce": 2 * passes}
    return {"all_reduce": passes} if name == "gspo" and layout.cp > 1 else {}
