"""`gyre bench gpu`: the prepared check of Gyre's GPU path (issue 26, item 6), short enough for a lent GPU's budget.

What it checks and measures, on `--device` (default cuda; `--device cpu` runs the very same code on the CPU, which is
how the tests run it):
- `environment`: torch, CUDA, the GPU, megatron-core, transformers and the Mooncake build (whether it registers
  device memory); TF32 is switched off for the whole check, so that fp32 means fp32.
- `parity:PRESET` for the tiny, tiny-tied and tiny-moe presets (`gyre model init --preset ...`, weights spread wider
  than init and random norm weights, so a wrong mapping shows far above the tolerance): per-token log-probs of the
  megatron trainer (TP=1) and of transformers on the same HF directory, both on the device. fp32: within 1e-4
  (FP32_ATOL, the bound of the CPU parity tests). bf16 (the trainer's mixed precision: bf16 compute, fp32 master
  weights, against transformers loaded in bf16): bf16 keeps 8 significant bits (a relative rounding of 2^-9 per
  operation), so a bf16 model's log-probs miss the fp32 ones by an amount set by the model's depth and logit sizes,
  not by a fixed number; transformers' own bf16 error against the fp32 reference on the same tokens is the measure
  of it, and the trainer must be within BF16_RATIO times that plus BF16_SLACK (2x + 0.01: two bf16 programs whose
  kernels round in another order). Tokens/s of each forward.
- `train_step`: megatron trainer steps at TP=1 in fp32 and in bf16 with fp32 master weights on the device (the
  master buffer fp32, the model's parameters bf16): three forward/backward + AdamW steps on the same batch, each
  loss finite and the last below the first, and the bf16 update in the direction of the fp32 one (cosine); tokens/s
  of a training step.
- `engine`: the embedded engine's prompt log-probs against transformers (fp32, 1e-4) and its generation tokens/s.
  `EngineConfig` has no device: the embedded engine runs on the host CPU, and the part says so.
- `transfer`: Mooncake moving a tensor of `--device` between two agents in this process, in place (registered) where
  the build can and through the bounded host staging buffer, with GB/s of each (engines/transfer.py).

Each part runs in a child process with a bound of its own (`PART_BOUNDS_S`, and never past `--budget-s` in all): a
part that fails reports its error, one that hangs or kills its process is reported so and the child is restarted for
the parts after it. Exit status 0 when every part passed, 1 otherwise. `--out DIR` writes the report
(gpu_report.json) and the child's stderr (gpu_child_stderr.log).

On a GPU session (the device tool; /work/.library/device/README.md), from the repository root. Its image has torch,
transformers, safetensors, tokenizers, attrs, numpy and msgpack, but not megatron-core, structlog or Mooncake, and it
reaches no registry: first, here, download their wheels into .whl (ignored by git; 3.4 MiB, checked 2026-12):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1 structlog==25.5.0 pyzmq==27.1.0

(Mooncake's CUDA wheel, `mooncake-transfer-engine`, may be added the same way for the transfer part; without it
that part fails with "cannot import mooncake.engine" and the others run. Its size was not checked: the 64 MiB a
call may carry bounds it.)

then one device call, `carry` [".whl"], timeout_s 480 (the check stays under its 300 s budget plus start-up):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \\
    mkdir -p /tmp/farm/gyre && for p in messages runtime engines policies actors benchmarks simulate; do \\
    ln -sfn $PWD/$p /tmp/farm/gyre/$p; done && PYTHONPATH=/tmp/farm:/tmp/site PYTHONUNBUFFERED=1 \\
    python3 -m gyre.benchmarks.gpu --out $OUT

(the summary is the output's tail; the whole report, the same object `--json` prints, comes back as
$OUT/gpu_report.json, with the child's stderr beside it), then record it in BENCHMARKS.md with that command and the
device the reply names.

Wall-clock timing is fine here: this is a benchmark, not an actor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import selectors
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

PRESETS = ("tiny", "tiny-tied", "tiny-moe")
PARTS = ("environment", *(f"parity:{p}" for p in PRESETS), "train_step", "engine", "transfer")
PART_BOUNDS_S = {"environment": 90.0, "parity": 90.0, "train_step": 90.0, "engine": 60.0, "transfer": 60.0}
"""Seconds each part may take (`parity` for each preset); the environment part pays the imports (megatron-core's
take 5-13 s on a loaded 2-core machine) and CUDA's start."""
BUDGET_S = 300.0
"""All parts together: a part is cut at whatever is left, and parts not started by then are reported skipped."""
STARTUP_S = 30.0
"""How long a child may take to say it runs (an interpreter start)."""
FP32_ATOL = 1e-4
BF16_RATIO = 2.0
BF16_SLACK = 0.01
PARITY_LENGTHS = (128, 77, 33, 5)
"""Rows of the parity batch (tokens each): a full row, two partial ones and a short one, so padding is exercised."""
TRAIN_ROWS, TRAIN_TOKENS, TRAIN_STEPS = 8, 128, 3
ENGINE_REQUESTS, ENGINE_PROMPT_TOKENS, ENGINE_NEW_TOKENS = 8, 64, 32
TRANSFER_BYTES = {"cuda": 256 << 20, "cpu": 16 << 20}
TIMED_REPEATS = 5
"""Timed runs of each forward (after a warm-up); the median is reported."""
MARK = "@@gyre-gpu "
"""Prefix of the child's report lines on stdout (libraries may print there too)."""


# ---- the parts (run in the child) ---------------------------------------------------------------------------


def _check(name: str, value: float, bound: float, passed: bool | None = None) -> dict[str, Any]:
    """One checked figure: `passed` defaults to value <= bound (a NaN never passes)."""
    ok = passed if passed is not None else (not math.isnan(value) and value <= bound)
    return {"name": name, "value": value, "bound": bound, "ok": bool(ok)}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


_REPEATS = {"timed": TIMED_REPEATS}  # the child's --repeats


def _timed(device: str, fn: Callable[[], Any], repeats: int | None = None) -> tuple[float, Any]:
    """Median seconds of `fn` over `repeats` runs after one warm-up (device work synchronised), and its last
    result."""
    result = fn()
    _sync(device)
    times = []
    for _ in range(repeats or _REPEATS["timed"]):
        started = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    times.sort()
    return times[len(times) // 2], result


def _model_dir(workdir: Path, preset: str) -> Path:
    """A model directory of `preset` with weights spread wider than init and random norm weights (as the CPU parity
    tests make them), so that a wrong mapping or a dropped tie shows far above the tolerance."""
    from gyre.engines.model_format import PRESETS as SPECS
    from gyre.engines.model_format import init_model_dir, save_hf_state_dict
    from gyre.engines.testing import spread_state_dict

    path = workdir / preset
    if (path / "model.safetensors").is_file():
        return path
    init_model_dir(path, preset, seed=0)
    save_hf_state_dict(path, spread_state_dict(SPECS[preset], seed=21))
    return path


def _batch(vocab: int, lengths: tuple[int, ...], seed: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, vocab, (n,), generator=g)
    return ids, torch.tensor(lengths)


def _valid(lp: Any, lengths: Any) -> Any:
    """The log-probs of real tokens (positions 1..n-1 of each row), flat, on the host, fp32."""
    import torch

    return torch.cat([lp[i, 1:n].float().cpu() for i, n in enumerate(lengths.tolist())])


def _hf_model(model_dir: Path, dtype: Any, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def _hf_logprobs(model: Any, ids: Any, lengths: Any, device: str) -> Any:
    """transformers' per-token log-probs, each row run alone (no padding for transformers to mask)."""
    import torch

    from gyre.engines.trainer import token_logprobs

    out = torch.zeros(ids.shape, dtype=torch.float32)
    with torch.no_grad():
        for row, n in enumerate(lengths.tolist()):
            piece = ids[row : row + 1, :n].to(device)
            out[row, :n] = token_logprobs(model(piece).logits, piece, lengths[row : row + 1].to(device))[0].cpu()
    return out


def part_environment(device: str, workdir: Path) -> dict[str, Any]:
    import importlib.metadata as metadata

    import torch

    found: dict[str, Any] = {"device": device, "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                             "torch_cuda": torch.version.cuda}
    for package in ("megatron-core", "transformers", "mooncake-transfer-engine",
                    "mooncake-transfer-engine-non-cuda"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no CUDA device")
        props = torch.cuda.get_device_properties(0)
        found.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_memory_gib=round(
            props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    found["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    found["tf32_cudnn"] = torch.backends.cudnn.allow_tf32
    import megatron.core  # noqa: F401  (the import is part of what this part checks, and its time)

    from gyre.engines.transfer import registers_device_memory

    try:
        import mooncake.engine

        found["mooncake_registers_device_memory"] = registers_device_memory(mooncake.engine)
    except ImportError as error:
        found["mooncake_registers_device_memory"] = None
        found["mooncake_import_error"] = str(error)
    return found


def part_parity(device: str, workdir: Path, preset: str) -> dict[str, Any]:
    import torch

    from gyre.engines.model_format import ModelSpec
    from gyre.engines.trainer import MegatronTrainer, TrainerConfig

    model_dir = _model_dir(workdir, preset)
    spec = ModelSpec.from_model_dir(model_dir)
    ids, lengths = _batch(spec.vocab_size, PARITY_LENGTHS, seed=1)
    tokens = int(lengths.sum())
    found: dict[str, Any] = {"preset": preset, "tokens": tokens}
    references = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = _hf_model(model_dir, dtype, device)
        seconds, lp = _timed(device, lambda: _hf_logprobs(model, ids, lengths, device))
        references[name] = _valid(lp, lengths)
        found[f"transformers_{name}_tokens_per_s"] = tokens / seconds
        del model
    trained = {}
    for precision in ("fp32", "bf16"):
        trainer = MegatronTrainer(model_dir, TrainerConfig(device=device, precision=precision))
        assert trainer.param_buffer().device.type == device, trainer.param_buffer().device
        seconds, lp = _timed(device, lambda: trainer.logprobs(ids, lengths))
        trained[precision] = _valid(lp, lengths)
        found[f"trainer_{precision}_tokens_per_s"] = tokens / seconds
        del trainer
    reference = references["fp32"]
    spread = float(reference.std())
    fp32 = float((trained["fp32"] - reference).abs().max())
    hf_bf16 = float((references["bf16"] - reference).abs().max())
    bf16 = float((trained["bf16"] - reference).abs().max())
    found.update(
        reference_logprob_std=spread,
        fp32_max_abs_diff=fp32,
        bf16_max_abs_diff=bf16,
        bf16_mean_abs_diff=float((trained["bf16"] - reference).abs().mean()),
        transformers_bf16_max_abs_diff=hf_bf16,
        transformers_bf16_mean_abs_diff=float((references["bf16"] - reference).abs().mean()),
        bf16_trainer_vs_transformers_bf16=float((trained["bf16"] - references["bf16"]).abs().max()),
    )
    found["checks"] = [
        _check("log-probs spread (not near-uniform: the comparison means something)", spread, 0.3, spread > 0.3),
        _check("fp32 trainer vs transformers, max |diff|", fp32, FP32_ATOL),
        _check("bf16 trainer vs fp32 transformers, max |diff| <= 2 x transformers' own bf16 error + 0.01", bf16,
               BF16_RATIO * hf_bf16 + BF16_SLACK),
    ]
    return found


def part_train_step(device: str, workdir: Path) -> dict[str, Any]:
    import torch

    from gyre.engines.model_format import ModelSpec
    from gyre.engines.trainer import MegatronTrainer, TrainerConfig

    model_dir = _model_dir(workdir, "tiny")
    spec = ModelSpec.from_model_dir(model_dir)
    ids, lengths = _batch(spec.vocab_size, (TRAIN_TOKENS,) * TRAIN_ROWS, seed=2)
    count = float((lengths - 1).sum())

    def nll(lp: Any) -> tuple[Any, dict]:
        return -lp.sum() / count, {}

    found: dict[str, Any] = {"rows": TRAIN_ROWS, "tokens_per_row": TRAIN_TOKENS, "steps": TRAIN_STEPS}
    checks = []
    deltas = {}
    for precision in ("fp32", "bf16"):
        trainer = MegatronTrainer(model_dir, TrainerConfig(device=device, precision=precision, lr=1e-3))
        master = trainer.param_buffer()
        model_dtype = {str(p.dtype) for p in trainer.model.parameters()}
        before = master.detach().clone()
        trainer.forward_backward(ids, lengths, nll)  # warm-up (kernels, allocator), not a step
        trainer.zero_grads()
        _sync(device)
        losses, times, norms = [], [], []
        for _ in range(TRAIN_STEPS):
            started = time.perf_counter()
            metrics = trainer.forward_backward(ids, lengths, nll)
            step = trainer.optimizer_step()
            _sync(device)
            times.append(time.perf_counter() - started)
            losses.append(metrics["loss"])
            norms.append(step["grad_norm"])
        deltas[precision] = (master.detach() - before).float().cpu()
        times.sort()
        found[precision] = {"losses": losses, "grad_norms": norms, "version": trainer.version,
                            "master_dtype": str(master.dtype), "master_device": str(master.device),
                            "model_param_dtypes": sorted(model_dtype),
                            "step_tokens_per_s": TRAIN_ROWS * TRAIN_TOKENS / times[len(times) // 2]}
        finite = all(math.isfinite(x) for x in losses + norms)
        checks += [
            _check(f"{precision}: losses and grad norms finite", float(not finite), 0.0),
            _check(f"{precision}: last loss below the first", losses[-1] - losses[0], 0.0, losses[-1] < losses[0]),
            _check(f"{precision}: fp32 master weights on {device}", 0.0, 0.0,
                   master.dtype == torch.float32 and master.device.type == device),
            _check(f"{precision}: model computes in {precision}", 0.0, 0.0,
                   model_dtype == {"torch.float32" if precision == "fp32" else "torch.bfloat16"}),
        ]
        del trainer
    cosine = float(torch.nn.functional.cosine_similarity(deltas["fp32"], deltas["bf16"], dim=0))
    found["update_cosine_bf16_vs_fp32"] = cosine
    checks.append(_check("bf16 update along the fp32 one (cosine >= 0.9)", cosine, 0.9, cosine >= 0.9))
    found["checks"] = checks
    return found


def part_engine(device: str, workdir: Path) -> dict[str, Any]:
    import torch

    from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig
    from gyre.engines.sampling import SamplingParams

    model_dir = _model_dir(workdir, "tiny")
    found: dict[str, Any] = {"engine_device": "cpu", "asked_device": device,
                             "why": "EngineConfig has no device: the embedded engine runs on the host CPU"}
    engine = EmbeddedEngine(model_dir, EngineConfig(num_blocks=256, max_context_tokens=512))
    ids, lengths = _batch(engine.spec.vocab_size, PARITY_LENGTHS, seed=3)
    model = _hf_model(model_dir, torch.float32, "cpu")
    reference = _valid(_hf_logprobs(model, ids, lengths, "cpu"), lengths)
    scored = torch.cat([torch.tensor(engine.prompt_logprobs(ids[i, :n].tolist()))
                        for i, n in enumerate(lengths.tolist())])
    diff = float((scored - reference).abs().max())
    found["prompt_logprobs_max_abs_diff"] = diff
    g = torch.Generator().manual_seed(4)
    params = SamplingParams(max_new_tokens=ENGINE_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    generated = 0
    started = time.perf_counter()
    for r in range(ENGINE_REQUESTS):
        prompt = torch.randint(0, engine.spec.vocab_size, (ENGINE_PROMPT_TOKENS,), generator=g).tolist()
        engine.submit(f"r{r}", prompt, params)
    while engine.has_work():
        generated += sum(len(event.token_ids) for event in engine.step())
    seconds = time.perf_counter() - started
    found["generation_tokens_per_s"] = generated / seconds
    found["checks"] = [_check("embedded engine vs transformers (fp32, cpu), max |diff|", diff, FP32_ATOL),
                       _check("every request generated its tokens", generated, ENGINE_REQUESTS * ENGINE_NEW_TOKENS,
                              generated == ENGINE_REQUESTS * ENGINE_NEW_TOKENS)]
    return found


def part_transfer(device: str, workdir: Path) -> dict[str, Any]:
    import torch

    from gyre.engines.transfer import TransferAgent, TransferConfig

    nbytes = TRANSFER_BYTES[device]
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    found: dict[str, Any] = {"bytes": nbytes}
    checks = []
    with TransferAgent() as server:
        # The source must be readable by the peer: in place where the build can register it, else a host copy.
        served = source if server.can_register(source) else source.cpu()
        server.register_tensor(served)
        found["server_device_memory"] = server.device_memory
        for mode in ("auto", "stage"):
            with TransferAgent(TransferConfig(device_memory=mode)) as agent:
                into = torch.zeros(nbytes, dtype=torch.uint8, device=device)
                # auto: a target the agent can register is registered (moved in place); stage: never registered.
                if mode == "auto" and agent.can_register(into):
                    agent.register_tensor(into)
                seconds, _ = _timed(device, lambda: agent.pull_tensor(server.peer, served.data_ptr(), into))
                stats = agent.statistics()
                path = "staged" if stats.bytes_staged else "in place"
                found[mode] = {"path": path, "gb_per_s": nbytes / seconds / 1e9, "agent_mode": agent.device_memory,
                               "chunks_staged": stats.chunks_staged}
                checks.append(_check(f"{mode}: pulled bytes equal the source ({path})", 0.0, 0.0,
                                     bool(torch.equal(into, source))))
    found["checks"] = checks
    return found


def _run_part(name: str, device: str, workdir: Path) -> dict[str, Any]:
    if name == "environment":
        return part_environment(device, workdir)
    if name.startswith("parity:"):
        return part_parity(device, workdir, name.split(":", 1)[1])
    return {"train_step": part_train_step, "engine": part_engine, "transfer": part_transfer}[name](device, workdir)


def _child(parts: list[str], device: str, workdir: Path, repeats: int) -> int:
    """Run `parts` in order, one report line each (started, then done with its result or error)."""
    import torch

    _REPEATS["timed"] = repeats
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity must not run on TF32 matrix units
    torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    for name in parts:
        print(MARK + json.dumps({"event": "start", "part": name}), flush=True)
        started = time.perf_counter()
        try:
            result = _run_part(name, device, workdir)
            result["ok"] = all(c["ok"] for c in result.get("checks", ()))
        except BaseException as error:  # noqa: BLE001 (a part's failure is its report; the next part still runs)
            result = {"ok": False, "error": f"{type(error).__name__}: {error}",
                      "traceback": traceback.format_exc(limit=8)[-4000:]}
        result["seconds"] = round(time.perf_counter() - started, 2)
        print(MARK + json.dumps({"event": "done", "part": name, "result": result}, default=str), flush=True)
    return 0


# ---- the parent: bounds, restarts, the report ---------------------------------------------------------------


def _bound(part: str) -> float:
    return PART_BOUNDS_S[part.split(":", 1)[0]]


def run_bench(device: str = "cuda", parts: tuple[str, ...] = PARTS, budget_s: float = BUDGET_S,
              workdir: str | None = None, stderr_path: str | None = None,
              bounds: dict[str, float] | None = None, repeats: int = TIMED_REPEATS) -> dict[str, Any]:
    """Run `parts` in child processes, each within its bound (`bounds` overrides PART_BOUNDS_S by kind) and all
    within `budget_s`; the report. `repeats`: timed runs of each measured forward."""
    bounds = {**PART_BOUNDS_S, **(bounds or {})}
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown parts {unknown}; choose from {list(PARTS)}")
    results: dict[str, Any] = {}
    remaining = list(parts)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gyre-bench-gpu-") as scratch:
        work = Path(workdir or scratch)
        work.mkdir(parents=True, exist_ok=True)
        log_path = Path(stderr_path or Path(scratch) / "child_stderr.log")
        with open(log_path, "ab") as stderr:
            while remaining:
                left = budget_s - (time.monotonic() - started)
                if left <= 0:
                    break
                _one_child(device, remaining, work, stderr, log_path, results, bounds, started, budget_s, repeats)
        for part in remaining:
            results[part] = {"ok": False, "skipped": True, "error": f"not started: the {budget_s:.0f} s budget "
                             "was spent"}
    report = {"device": device, "budget_s": budget_s, "seconds": round(time.monotonic() - started, 1),
              "parts": {p: results[p] for p in parts}, "ok": all(results[p]["ok"] for p in parts)}
    return report


def _one_child(device: str, remaining: list[str], work: Path, stderr: Any, log_path: Path,
               results: dict[str, Any], bounds: dict[str, float], started: float, budget_s: float,
               repeats: int) -> None:
    """One child process over `remaining` (in order), until it ends or a part outlives its bound; finished and
    failed parts leave `remaining`."""
    command = [sys.executable, "-m", "gyre.benchmarks.gpu", "--child", "--device", device, "--workdir", str(work),
               "--parts", ",".join(remaining), "--repeats", str(repeats)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
    selector = selectors.DefaultSelector()
    selector.register(child.stdout, selectors.EVENT_READ)
    current, deadline = None, time.monotonic() + STARTUP_S
    buffered = b""
    events = 0
    try:
        while True:
            budget_end = started + budget_s
            wait = min(deadline, budget_end) - time.monotonic()
            line = b""
            if b"\n" not in buffered and wait > 0 and selector.select(timeout=wait):
                chunk = os.read(child.stdout.fileno(), 65536)
                if not chunk:  # the child ended
                    break
                buffered += chunk
            if b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
            elif time.monotonic() >= min(deadline, budget_end):
                what = current or remaining[0]
                results[what] = {"ok": False, "error": f"timed out after {time.monotonic() - part_started:.0f} s "
                                 f"(bound {min(bounds[what.split(':', 1)[0]], budget_s):.0f} s)" if current else
                                 "the child process did not start in time"}
                remaining.remove(what)
                return
            else:
                continue
            text = line.decode("utf-8", "replace")
            if not text.startswith(MARK):
                continue
            event = json.loads(text[len(MARK) :])
            events += 1
            if event["event"] == "start":
                current, part_started = event["part"], time.monotonic()
                deadline = part_started + bounds[current.split(":", 1)[0]]
            else:
                results[event["part"]] = event["result"]
                remaining.remove(event["part"])
                current, deadline = None, time.monotonic() + STARTUP_S
        if current is not None or not events:  # the process died inside a part, or before any
            child.wait(10)
            tail = log_path.read_bytes()[-2000:].decode("utf-8", "replace")
            what = current or remaining[0]
            where = "inside the part" if current else "before it began a part"
            results[what] = {"ok": False, "error": f"the process ended (status {child.returncode}) {where}; stderr "
                             f"ends: {tail}"}
            remaining.remove(what)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, 9)  # its own session: a hung CUDA call takes its helpers with it
        child.wait(30)
        selector.close()
        child.stdout.close()


def summary_lines(report: dict[str, Any]) -> list[str]:
    """One line per part and per check, for a terminal."""
    lines = [f"gyre bench gpu on {report['device']}: {'all passed' if report['ok'] else 'FAILED'} "
             f"in {report['seconds']} s"]
    for name, part in report["parts"].items():
        lines.append(f"{'ok  ' if part['ok'] else 'FAIL'} {name} ({part.get('seconds', '-')} s)"
                     + (f": {part['error'].splitlines()[0][:200]}" if part.get("error") else ""))
        for check in part.get("checks", ()):
            lines.append(f"       {'ok  ' if check['ok'] else 'FAIL'} {check['name']}: {check['value']:.3g} "
                         f"(bound {check['bound']:.3g})")
        for key, value in _rates(part):
            lines.append(f"       {key}: {value:.4g}")
    return lines


def _rates(found: dict[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    """The tokens/s and GB/s figures of a part's result, nested ones named by their path."""
    rates = []
    for key, value in found.items():
        if isinstance(value, dict):
            rates += _rates(value, f"{prefix}{key}.")
        elif key.endswith(("tokens_per_s", "gb_per_s")) and isinstance(value, (int, float)):
            rates.append((prefix + key, float(value)))
    return rates


def _handle(args: argparse.Namespace) -> int:
    parts = tuple(args.parts.split(",")) if args.parts else PARTS
    if args.child:
        return _child(list(parts), args.device, Path(args.workdir), args.repeats)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    report = run_bench(args.device, parts, args.budget_s, workdir=args.workdir,
                       stderr_path=str(out / "gpu_child_stderr.log") if out else None, repeats=args.repeats)
    if out is not None:
        (out / "gpu_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print("\n".join(summary_lines(report)), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report, default=str))
    return 0 if report["ok"] else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "gpu", help="the prepared GPU check: trainer bf16/fp32 steps, log-prob parity with transformers, tokens/s",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where the checks run (cpu: the same code on the host, as the tests run it)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object (the summary to stderr)")
    p.add_argument("--out", default=None, metavar="DIR", help="write gpu_report.json and the child's stderr there")
    p.add_argument("--parts", default=None, help=f"comma-separated parts to run (default all: {','.join(PARTS)})")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all parts together")
    p.add_argument("--workdir", default=None, help="where the model directories go (default: a temporary one)")
    p.add_argument("--repeats", type=int, default=TIMED_REPEATS, help="timed runs of each measured forward")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=_handle)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="gyre.benchmarks.gpu")
    register(parser.add_subparsers(dest="bench", required=True))
    parsed = parser.parse_args(["gpu", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
