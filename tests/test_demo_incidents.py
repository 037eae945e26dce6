"""The demo's --plant-bad-sample end to end: the incident names the planted sample; --skip-samples leaves it out."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from kit.example_script import load_train_gpt
from kit.fork_server import run_python

from twinkle_megatron.cli import main
from twinkle_megatron.tracker.incidents import load_incidents, read_skip_list

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
STEP = 70


def test_the_planted_sample_is_named_and_printed(tmp_path, capsys):
    """TP2 × PP2, two samples a step; a spike threshold of 0 flags every step whose loss passes its EMA, the
    planted step among them (its bad sample's loss is several times the other's)."""
    flags = ["--tp", "2", "--pp", "2", "--dp", "1", "--micro-batch-size", "1", "--microbatches", "2",
             "--steps", str(STEP), "--log-interval", "1", "--plant-bad-sample", str(STEP), "--spike-threshold", "0",
             "--layer-norms", "--log-dir", str(tmp_path), "--run-name", "run", "--backends", "jsonl"]
    done = run_python([str(SCRIPT), *flags], timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    planted = (STEP - 1) * 2 + 1  # the middle of the step's global batch of 2
    incident = {i["step"]: i for i in load_incidents(str(tmp_path / "run"))}[STEP]
    top = incident["samples"][0]
    assert (top["sample_index"], top["step"], top["complete"]) == (planted, STEP, True), incident
    assert top["dataset"] in ("easy", "hard") and top["loss"] > 2 * incident["samples"][1]["loss"]
    assert incident["layers"] and all(layer["grad_norm"] > 0 for layer in incident["layers"])
    assert f"[incident] step {STEP}: loss_spike" in done.stdout
    main(["incidents", str(tmp_path / "run")])
    assert f"top sample {planted} (dataset {top['dataset']}" in capsys.readouterr().out


def test_skipped_samples_keep_their_place_with_no_loss(tmp_path):
    train_gpt = load_train_gpt("train_gpt_incidents")
    skip = tmp_path / "skip.txt"
    skip.write_text("5\n")
    args = argparse.Namespace(seed=1, seq_length=8, vocab_size=61, micro_batch_size=2, microbatches=2, dp=1,
                              plant_bad_sample=2, skipped_samples=read_skip_list(str(skip)))
    sample = {"tokens": torch.arange(8), "labels": torch.arange(1, 9), "loss_mask": torch.ones(8)}
    assert train_gpt.health_checked(args, 5, sample)["loss_mask"].sum() == 0
    assert train_gpt.health_checked(args, 4, sample)["loss_mask"].sum() == 8
    planted = train_gpt.planted_sample(args)
    assert planted == 4 + 2  # step 2's batch of 4: samples 4..7, the middle one
    assert torch.equal(train_gpt.health_checked(args, planted, sample)["labels"], (torch.arange(1, 9) + 30) % 61)
