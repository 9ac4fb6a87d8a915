"""`topk calibrate-duo`: learn DuoAttention head gates for a checkpoint and write them as a TSV pattern."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from topk_decode.cli.common import check_device, console


def calibrate_duo_command(
    model_dir: Annotated[Path, typer.Argument(help="Local Llama / Qwen2 / Mistral checkpoint directory or GGUF file.")],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Where to write the gates (full_attention_heads.tsv format).")
    ],
    steps: Annotated[int, typer.Option(help="Adam steps, one synthetic passkey prompt each.")] = 200,
    length: Annotated[int, typer.Option(help="Context tokens per passkey prompt.")] = 2048,
    sink: Annotated[int, typer.Option(help="Attention-sink tokens a streaming head keeps.")] = 64,
    recent: Annotated[int, typer.Option(help="Recent tokens a streaming head keeps.")] = 256,
    l1: Annotated[float, typer.Option("--l1", help="Weight of the L1 penalty on the mean gate.")] = 0.05,
    lr: Annotated[float, typer.Option(help="Adam learning rate.")] = 0.02,
    device: Annotated[str | None, typer.Option(help="cuda, cuda:N or cpu (default: cuda when available).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic prompts.")] = 0,
) -> None:
    """Learn DuoAttention head gates (retrieval vs streaming) for a model; use them with --strategy duo."""
    check_device(device)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from topk_decode.calibrate.duo import DuoCalibrationConfig, calibrate_duo_to_file

    config = DuoCalibrationConfig(steps=steps, length=length, sink=sink, recent=recent, l1=l1, lr=lr, seed=seed)
    config.validate()
    err = console(stderr=True)
    with Progress(
        TextColumn("calibrating"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task("calibrate", total=steps, info="")

        def progress(step: int, total: int, loss: float, mean_gate: float) -> None:
            bar.update(task, completed=step, info=f"mse {loss:.3e}  mean gate {mean_gate:.3f}")

        result = calibrate_duo_to_file(model_dir, out, config, device=device, progress=progress)
    gates = result.gates
    con = console()
    con.print(f"wrote {out}: {gates.shape[0]} layers × {gates.shape[1]} KV heads", markup=False, soft_wrap=True)
    con.print(
        f"final distillation mse {result.distill_loss[-1]:.4e}; gates mean {float(gates.mean()):.3f}, "
        f"min {float(gates.min()):.3f}, median {float(gates.median()):.3f}, max {float(gates.max()):.3f}"
    )
    for i, row in enumerate(gates):
        con.print(f"  layer {i:>3}: " + " ".join(f"{float(g):.2f}" for g in row))
