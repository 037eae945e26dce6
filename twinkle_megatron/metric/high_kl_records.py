"""GRPO's ``top_k_kl`` records: the K tokens of highest k3 over all ranks, numbered in the global batch."""

from __future__ import annotations

from typing import Any

RECORD_FIELDS = ("kl", "ratio", "logp_new", "logp_old", "token_id", "sequence", "position", "call")


def global_top_kl(records: list, top_k: int) -> list[dict[str, Any]]:
    """The top-K of all ranks' ``records``, with sequence indices in the global batch."""
    counts: dict[tuple[int, int], int] = {}
    tokens = []
    for record in records:
        if record[0] == "sequences":
            _, call, dp_rank, count = record
            counts[(call, dp_rank)] = max(count, counts.get((call, dp_rank), 0))  # CP ranks agree
        else:
            tokens.append(record[1:])
    offsets, running = {}, 0
    for call, dp_rank in sorted(counts):
        offsets[(call, dp_rank)] = running
        running += counts[(call, dp_rank)]
    results = [{
        "gsi": offsets.get((int(fields["call"]), dp_rank), 0) + int(fields["sequence"]),
        "pos": int(fields["position"]),
        "token_id": int(fields["token_id"]),
        "kl": fields["kl"],
        "ratio": fields["ratio"],
        "logp_new": fields["logp_new"],
        "logp_old": fields["logp_old"],
    } for dp_rank, fields in tokens]
    results.sort(key=lambda r: (-r["kl"], r["gsi"], r["pos"]))
    return results[:top_k]
