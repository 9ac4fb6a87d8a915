"""`topk calibrate-duo`: learn DuoAttention head gates for a checkpoint and write them as a TSV pattern."""

from __future__ import annotations

from pathlib import Path

import typer

from topk_decode.cli.common import check_device, console


def calibrate_duo_command(
    model_dir: Path = typer.Argument(..., help="Local Llama / Qwen2 / Mistral checkpoint directory."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the gates (full_attention_heads.tsv format)."),
    steps: int = typer.Option(200, "--steps", help="Adam steps, one synthetic passkey prompt each."),
    length: int = typer.Option(2048, "--length", help="Context tokens per passkey prompt."),
    sink: int = typer.Option(64, "--sink", help="Attention-sink tokens a streaming head keeps."),
    recent: int = typer.Option(256, "--recent", help="Recent tokens a streaming head keeps."),
    l1: float = typer.Option(0.05, "--l1", help="Weight λ of the L1 penalty on the mean gate."),
    lr: float = typer.Option(0.02, "--lr", help="Adam learning rate."),
    device: str = typer.Option(None, "--device", help="cuda, cuda:N or cpu (default: CUDA when available)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic prompts."),
) -> None:
    """Learn one gate per (layer, KV head) by distilling full attention into sinks + recent streaming.

    Use the result with `--strategy duo --opt pattern=PATH [--opt sparsity=0.5]`.

    Args:
        model_dir: the checkpoint directory.
        out: the TSV file to write.
        steps, length, sink, recent, l1, lr, seed: calibration settings (see DuoCalibrationConfig).
        device: compute device.
    """
    check_device(device)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from topk_decode.calibrate.duo import DuoCalibrationConfig, calibrate_duo_to_file

    config = DuoCalibrationConfig(steps=steps, length=length, sink=sink, recent=recent, l1=l1, lr=lr, seed=seed)
    config.validate()
    with Progress(TextColumn("calibrating"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console(stderr=True)) as bar:
        task = bar.add_task("calibrate", total=steps, info="")

        def progress(step: int, total: int, loss: float, mean_gate: float) -> None:
            bar.update(task, completed=step, info=f"mse {loss:.3e}  mean gate {mean_gate:.3f}")

        result = calibrate_duo_to_file(model_dir, out, config, device=device, progress=progress)
    gates = result.gates
    con = console()
    con.print(f"wrote {out}: {gates.shape[0]} layers × {gates.shape[1]} KV heads")
    con.print(f"final distillation mse {result.distill_loss[-1]:.4e}; gates mean {float(gates.mean()):.3f}, "
              f"min {float(gates.min()):.3f}, median {float(gates.median()):.3f}, max {float(gates.max()):.3f}")
    for i, row in enumerate(gates):
        con.print(f"  layer {i:>3}: " + " ".join(f"{float(g):.2f}" for g in row))
