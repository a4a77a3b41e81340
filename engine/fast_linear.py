"""Linear layers on the CPU through our C++ kernels (``batchery.engine.cpu_kernels``).

torch's CPU matmuls go to MKL (fp32) and oneDNN (bf16). On the machines we measured (AMD EPYC) MKL's
sgemm takes a generic, slow path, and both libraries leave memory bandwidth unused at the small row
counts of decode steps; our kernels (a 6 x 64 register tile; ``vdpbf16ps`` for bf16) ran 1.1-2x
faster there (``benchmarks/cpu_kernels.py``). Where a library is better (MKL on Intel, oneDNN's LM
head at many rows) it should keep the work, so ``install`` times both on each distinct layer shape
at a few row counts and routes a layer's inputs to the kernel only up to the row count where the
kernel stopped winning.

- fp32: the kernel reads a copy of the weight in 64-column panels (``pack_panels``: the transposed weight, each
  panel's [in, 64] block contiguous), so a layer holds its fp32 weight twice (``weight`` is kept as it is, for the
  row counts torch handles, and a head tied to the embedding stays tied). Read transposed ([in, out]), each k row of
  a panel is a 256-byte piece ``out`` floats from the last, on a page of its own for a 49k-wide LM head, which the
  hardware prefetcher streams badly; in panels every layer streams. On the 2-core Zen 4 EPYC (2026-12-04),
  SmolLM2's layers, 30 weights in turn: 1.4-1.85x the transposed read at 1-16 rows, 1.0-1.14x at 32-256 (down_proj,
  1536 in, gained most), bit for bit the same sums; the 96-request fp32 reference pass 2-4.5% faster. Until then
  only ``WIDE`` layers had panels, and the others' transposed copy was their storage.
- bf16: the kernel reads a packed copy of the weight (pairs along ``in``, in 64-column panels); ``weight`` is kept
  for the row counts torch handles, so routed bf16 layers hold their weights twice. With AVX512-BF16 it multiplies
  pairs with ``vdpbf16ps``; with AVX2 or AVX-512 alone it widens each pair to fp32 by shifts (exact) and uses FMAs,
  still reading half the bytes of an fp32 weight. On the 2-core AVX2 EPYC (Zen 3) that was 2-8x torch's bf16
  matmul (which has no native path there) at 1-256 rows on SmolLM2's shapes.
- bf16 on CPUs with AMX-BF16 (and Linux granting the tile state), layers whose sides are multiples of 32: the
  kernel is ``linear_amx`` on a copy packed into 1 KB tiles (``pack_amx``), a tile multiply (``tdpbf16ps``) doing
  8,192 multiply-adds; on the 2-core AMX Xeon it ran 2-3 TFLOPS on SmolLM2's layers with their weights in cache,
  where ``vdpbf16ps`` managed 0.25 and oneDNN 1-2.5. An MLP whose gate and up projections both run on it also
  gets one pass for both and SiLU(gate) * up (``_install_gate_up``).
- Beyond the kernel's row limit (or from the first row where there is no kernel: bf16 on CPUs with AVX-512
  but no AVX512-BF16) a second route is calibrated the same way: oneDNN's matmul on a copy of the weight
  reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, as torch's inductor
  packs frozen weights; on AMX CPUs oneDNN's bf16 runs on the tiles). ``F.linear`` packs nothing and, for fp32,
  calls MKL. A layer routed to it holds its weight twice. Where this torch or CPU has no such path (bf16 on
  AVX2) the route is never calibrated.
- On AVX2 (no AVX-512) the register tile is 6 x 16 of 8-float vectors: until 2026-12-03 it was written with 64-byte
  vectors, which GCC keeps in memory on AVX2 (8 GFLOPS on a Zen 3 core), so MKL and oneDNN won everywhere there.

It is installed on the loaded model itself, so everything that runs the model (the engine, and the
HF baselines in our benchmarks) uses the same kernels. Set ``BATCHERY_CPU_KERNELS=0`` to keep torch.

Calibration times F.linear at up to 512 rows (the fp32 LM head of a 49k vocabulary alone takes
seconds), so the loader keeps its results in the model cache (``<cache>/calibration/cpu-linear.json``), keyed
by everything that could change them: the CPU (its model name and flags), the cores this process may
use and torch's thread count, torch's version, the kernels' source and the calibration's own rows.
A start on the same machine and software reads them; any change calibrates again. Delete the file to
recalibrate; ``BATCHERY_CPU_CALIBRATION_CACHE=0`` neither reads nor writes it."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from batchery.engine import cpu_kernels, fused_llama

log = logging.getLogger("batchery.engine.kernels")

# decode batches sit between 64 and 256 rows: an LM head can win at 128 and lose at 512
CALIBRATION_ROWS = (8, 64, 128, 256, 512)
WIDE = 4096  # layers with at least this many outputs (an LM head) are calibrated up to 256 rows only
QKV_MAX_ROWS = 256  # q, k and v in one pass up to this many rows (``_install_qkv``)
ANY = 1 << 62
CALIBRATION_CACHE_ENV = "BATCHERY_CPU_CALIBRATION_CACHE"  # "0": calibrate at every start
_CALIBRATION_VERSION = 5  # bump when calibrate() measures differently (3: packed oneDNN; 4: its rival; 5: fp32 panels)
_MAX_HOSTS = 32  # host keys kept in the file (a model cache shared by several machines)


KernelLinear = Callable[..., torch.Tensor]  # (x [..., in], bias [out] | None) -> [..., out] through the kernel


class _RoutedLinear(torch.nn.Linear):
    """Typing only, never instantiated: the attributes ``install`` sets on an ``nn.Linear`` it routes."""

    _batchery_linear: KernelLinear
    _batchery_kernel: types.ModuleType  # the compiled kernels (``cpu_kernels.load()``)
    _batchery_max_rows: int  # inputs of up to this many rows go to the kernel
    _batchery_onednn: KernelLinear | None  # oneDNN on a weight packed once, for the rows beyond the kernel's
    _batchery_onednn_rows: int  # inputs of up to this many rows (and more than _batchery_max_rows) go to oneDNN


def _forward(self: _RoutedLinear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == self.weight.dtype and not x.requires_grad and x.device.type == "cpu":
        numel = x.numel()
        if numel <= self._batchery_max_rows * x.shape[-1]:
            return self._batchery_linear(x, self.bias)
        if self._batchery_onednn is not None and numel <= self._batchery_onednn_rows * x.shape[-1]:
            return self._batchery_onednn(x, self.bias)
    return F.linear(x, self.weight, self.bias)


def _torch_linear(lin: torch.nn.Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, lin.weight, bias)


ONEDNN_ROWS_HINT = 64  # the row count oneDNN packs a weight for (decode batches; any row count runs on it)


def _onednn_fn(w: torch.Tensor) -> KernelLinear | None:
    """(x, bias) -> y by oneDNN on a copy of ``w`` reordered once into its blocked layout (what torch's inductor
    does for frozen weights), or None where this torch or CPU has no such path (bf16 without AVX512-BF16 /
    AVX-NE-CONVERT). F.linear reorders nothing and runs MKL's sgemm for fp32: on a 2-core AVX2 EPYC the packed
    oneDNN matmul was 1.25-2x faster at 8-256 rows (SmolLM2-135M layer shapes)."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = mkldnn._reorder_linear_weight(w.detach(), ONEDNN_ROWS_HINT)
        probe = torch.zeros(1, w.shape[1], dtype=w.dtype)
        mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as e:
        log.debug("no packed oneDNN linear for %s weights here: %s", w.dtype, e)
        return None
    op = mkldnn._linear_pointwise

    def run(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return op(x, packed, bias, "none", [], "")

    return run


def _faster(a: Callable[[], object], b: Callable[[], object], reps: int = 5) -> bool:
    """Whether ``a``'s best time beats ``b``'s, timed in turns so that a burst of load elsewhere on the machine
    slows both rather than deciding the comparison."""
    a()
    b()
    best_a = best_b = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        best_a, best_b = min(best_a, t1 - t0), min(best_b, t2 - t1)
    return best_a < best_b


def _kernel_fn(kernel: types.ModuleType, w: torch.Tensor) -> tuple[KernelLinear, torch.Tensor]:
    """(callable (x, bias) -> y through the kernel, the tensor that callable reads: for fp32 the weight's
    64-column panels, for bf16 the packed copy (AMX tiles or vdpbf16ps pairs))"""
    n = w.shape[0]
    if w.dtype == torch.float32:
        panels = kernel.pack_panels(w)
        return (lambda x, bias=None: kernel.linear_panels(x, panels, n, bias)), panels
    if uses_amx(kernel, w):
        tiles = kernel.pack_amx(w)
        return (lambda x, bias=None: kernel.linear_amx(x, tiles, bias)), tiles
    packed = kernel.pack_bf16(w)
    return (lambda x, bias=None: kernel.linear_bf16(x, packed, n, bias)), packed


def uses_amx(kernel: types.ModuleType, w: torch.Tensor) -> bool:
    """Whether a bf16 weight's kernel is the AMX one (``linear_amx``): the CPU has AMX-BF16, Linux granted its
    tiles, and both sides of the weight are multiples of 32 (one tile multiply takes 32 k and 16 columns, in pairs
    of column blocks). Elsewhere bf16 weights take the ``vdpbf16ps`` kernel."""
    return (
        w.dtype == torch.bfloat16
        and w.shape[0] % 32 == 0
        and w.shape[1] % 32 == 0
        and bool(getattr(kernel, "has_amx_linear", lambda: False)())
    )


def calibrate(kernel: types.ModuleType, in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> int:
    """The largest row count (0: none; ``ANY``: every one tried) up to which the kernel beats
    ``F.linear`` here, timed on random data of one layer's shape. A ``WIDE`` layer (an LM head, which sees one
    row per sampled sequence) is tried up to 256 rows: its 512-row fp32 timing alone took seconds."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    fn, _ = _kernel_fn(kernel, w)
    onednn = _onednn_fn(w)
    return _limit(fn, w, g, after=0, rivals=() if onednn is None else (onednn,))


def _limit(
    fn: KernelLinear, w: torch.Tensor, g: torch.Generator, after: int, rivals: tuple[KernelLinear, ...] = ()
) -> int:
    """The largest of the row counts above ``after`` up to which ``fn`` beats ``F.linear`` (and each of
    ``rivals``) on ``w`` in a row (``ANY`` when it won up to the last one); a ``WIDE`` layer is tried up to 256
    rows. A loss is timed again before it counts: it ends the search and is cached, and one stall of the machine
    during a few milliseconds of timing once kept a kernel 2.4x faster than torch off every row count from 256 up
    (2-core AMD EPYC). The kernel's rival is also the packed oneDNN route, which takes the rows after the
    kernel's: on the AMX Xeon the AMX kernel beat ``F.linear`` at every row count but oneDNN's AMX matmul beat
    it at 256 rows and more for a 576 -> 1536 layer (2x at 955)."""
    limit = 0
    rows_tried = [r for r in CALIBRATION_ROWS if (w.shape[0] < WIDE or r <= 256) and r > after]
    with torch.inference_mode():
        for rows in rows_tried:
            x = torch.randn(rows, w.shape[1], generator=g).to(w.dtype)
            ours = functools.partial(fn, x)
            for rival in [functools.partial(F.linear, x, w), *(functools.partial(r, x) for r in rivals)]:
                if not _faster(ours, rival) and not _faster(ours, rival, reps=9):
                    return limit
            limit = rows
    return ANY if rows_tried and rows_tried[-1] == CALIBRATION_ROWS[-1] else limit


def calibrate_onednn(in_features: int, out_features: int, dtype: torch.dtype, after: int) -> int:
    """The largest row count above ``after`` (the kernel's limit) up to which oneDNN on a packed weight beats
    ``F.linear`` here (0: none, or no packed oneDNN path; ``ANY``: every row count tried), timed as ``calibrate``
    times the kernel."""
    if after == ANY:
        return 0
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    fn = _onednn_fn(w)
    return 0 if fn is None else _limit(fn, w, g, after)


def _cpuinfo() -> dict[str, str]:
    """The identifying lines of the first CPU in /proc/cpuinfo (x86: model name, flags; Arm: Features...)."""
    keep = (
        "vendor_id",
        "model name",
        "cpu family",
        "model",
        "stepping",
        "flags",
        "Features",
        "CPU implementer",
        "CPU part",
    )
    out: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return out
    for line in text.split("\n\n", 1)[0].splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in keep:
            out[name] = " ".join(sorted(value.split())) if name in ("flags", "Features") else value.strip()
    return out


def calibration_host() -> dict[str, Any]:
    """What calibration results depend on besides the layer's shape and dtype."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    source = cpu_kernels.NAME + "\0" + cpu_kernels.full_source()
    return {
        "cpu": _cpuinfo(),
        "cpu_count": os.cpu_count(),
        "cores": cores,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kernel_source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "rows": list(CALIBRATION_ROWS),
        "calibration": _CALIBRATION_VERSION,
    }


class _CalibrationCache:
    """Row limits by layer shape for this host (``calibration_host``), read and written as JSON."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.host = calibration_host()
        self.key = hashlib.sha256(json.dumps(self.host, sort_keys=True).encode()).hexdigest()
        self.data: dict[str, Any] = {"hosts": {}}
        self.dirty = False
        try:
            data = json.loads(self.path.read_text())
            if isinstance(data, dict) and isinstance(data.get("hosts"), dict):
                self.data = data
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            log.warning("ignoring the unreadable CPU calibration cache %s: %s", self.path, e)
        entry = self.data["hosts"].get(self.key)
        self.limits: dict[str, Any] = (
            entry["limits"] if isinstance(entry, dict) and isinstance(entry.get("limits"), dict) else {}
        )
        # Timings taken beside other work (``busy``) are the other work's as much as ours. They are used while
        # the machine stays busy (a start is not slowed by calibrating again), and replaced at a quiet start.
        self.busy = _machine_busy()
        if self.limits and isinstance(entry, dict) and entry.get("busy") and self.busy is None:
            log.info("calibrating the CPU kernels again: the kept results were timed while %s", entry["busy"])
            self.limits = {}

    @staticmethod
    def _name(key: tuple[int, int, torch.dtype], route: str) -> str:
        name = f"{key[0]}x{key[1]}:{str(key[2]).removeprefix('torch.')}"
        return name if route == "kernel" else f"{name}:{route}"

    def get(self, key: tuple[int, int, torch.dtype], route: str = "kernel") -> int | None:
        limit = self.limits.get(self._name(key, route))
        return limit if isinstance(limit, int) and not isinstance(limit, bool) and 0 <= limit <= ANY else None

    def put(self, key: tuple[int, int, torch.dtype], limit: int, route: str = "kernel") -> None:
        self.limits[self._name(key, route)] = limit
        self.dirty = True

    def save(self) -> None:
        hosts = self.data["hosts"]
        hosts[self.key] = {"host": self.host, "limits": self.limits, "written": time.time()}
        if self.busy is not None:
            hosts[self.key]["busy"] = self.busy
        if len(hosts) > _MAX_HOSTS:  # drop the oldest
            for old in sorted(hosts, key=lambda k: hosts[k].get("written", 0) if isinstance(hosts[k], dict) else 0)[
                : len(hosts) - _MAX_HOSTS
            ]:
                del hosts[old]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".cpu-linear-")
            with os.fdopen(fd, "w") as f:
                json.dump(self.data, f, indent=1, sort_keys=True)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)  # atomic: a reader sees the old file or the new one
        except OSError as e:  # a read-only cache: calibrate again next time
            log.warning("could not write the CPU calibration cache %s: %s", self.path, e)
        self.dirty = False


def _machine_busy() -> str | None:
    """Why timings taken now are not this process's alone (the load average above the cores this process may
    use, as while other workers start beside it), or None."""
    try:
        load = float(Path("/proc/loadavg").read_text().split()[0])
        cores = len(os.sched_getaffinity(0))
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return f"load average {load:.1f} on {cores} cores" if load > cores + 0.5 else None


OTHERS_BUSY_SHARE = 0.25  # other processes' share of the machine's CPUs above which a calibration is not trusted


def _cpu_sample() -> tuple[float, int, int] | None:
    """(monotonic seconds, busy jiffies of the whole machine, jiffies of this process), or None where /proc does not
    tell. The machine's busy time counts steal (a hypervisor's other guests) and leaves out idle and iowait."""
    try:
        cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = sum(cpu) - cpu[3] - cpu[4]  # user nice system [idle iowait] irq softirq steal
        stat = Path("/proc/self/stat").read_text()
        own = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on: the name may hold spaces
        mine = int(own[11]) + int(own[12])  # utime and stime, all threads
    except (OSError, ValueError, IndexError):
        return None
    return time.monotonic(), busy, mine


def _others_share_since(start: tuple[float, int, int] | None) -> float | None:
    """The share of the machine's CPUs that other processes (and steal) used since ``start`` (``_cpu_sample``), or
    None when /proc does not tell or less than 0.2 s passed (too short for 10 ms jiffies)."""
    end = _cpu_sample()
    if start is None or end is None or end[0] - start[0] < 0.2:
        return None
    capacity = (end[0] - start[0]) * os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1)
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / capacity) if capacity > 0 else None


def _others_busy_since(start: tuple[float, int, int] | None) -> str | None:
    """Why timings taken since ``start`` were not this process's alone (other processes used more than
    ``OTHERS_BUSY_SHARE`` of the machine's CPUs meanwhile), or None. The load average (``_machine_busy``) lags by
    a minute: a worker started while a ``pip install`` ran beside it on the 2-core EPYC was not marked busy by it,
    calibrated SmolLM2's k/v projections off the kernel (576x192: 0 rows, ANY on the quiet machine), which also
    turned off q/k/v in one pass, and kept that."""
    share = _others_share_since(start)
    if share is None or share <= OTHERS_BUSY_SHARE:
        return None
    return f"other processes used {share:.0%} of the {os.cpu_count() or 1} CPUs"


def _calibration_cache_on() -> bool:
    return os.environ.get(CALIBRATION_CACHE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _eligible(lin: torch.nn.Module, kernel: types.ModuleType) -> bool:
    if not isinstance(lin, torch.nn.Linear) or getattr(lin, "_batchery_kernel", None) is not None:
        return False
    w = lin.weight
    if w.device.type != "cpu" or lin.out_features % 16:
        return False
    if w.dtype == torch.float32:
        return True
    return (
        w.dtype == torch.bfloat16 and lin.in_features % 2 == 0 and (_has_kernel(kernel, w.dtype) or _onednn_ok(w.dtype))
    )


def _has_kernel(kernel: types.ModuleType, dtype: torch.dtype) -> bool:
    """Whether our kernels have a linear for ``dtype`` here (fp32 always; bf16 with AVX512-BF16)."""
    return dtype == torch.float32 or bool(kernel.has_bf16_linear())


@functools.cache
def _onednn_ok(dtype: torch.dtype) -> bool:
    return _onednn_fn(torch.zeros(16, 16, dtype=dtype)) is not None


def install(
    model: torch.nn.Module,
    max_rows: int | None = None,
    calibration_cache: Path | None = None,
    one_pass: bool | None = None,
) -> int:
    """Route the model's fp32 and bf16 CPU ``nn.Linear`` layers through the kernels, for inputs of
    up to ``max_rows`` rows (None: calibrate each layer shape here, or read the calibration cache;
    -1: any). ``calibration_cache``: a JSON file that keeps calibration results for this host (the
    loader passes one in the model cache; None: calibrate every time). ``one_pass``: also give attention
    modules their q/k/v pass and MLPs their gate/up pass (``_install_qkv``, ``_install_gate_up``), each one
    more copy of those weights; None: only where the fused decoder layers, which call them, are installed
    (``fused_llama.install`` first). Returns how many layers were routed (0 when the kernels cannot be built
    here or never win)."""
    kernel = cpu_kernels.load()
    if kernel is None:
        return 0
    limits: dict[tuple[int, int, torch.dtype], tuple[int, int]] = {}  # (kernel, oneDNN) row limits
    use_cache = max_rows is None and calibration_cache is not None and _calibration_cache_on()
    cache = _CalibrationCache(calibration_cache) if use_cache and calibration_cache is not None else None
    sample = _cpu_sample() if cache is not None else None
    count = 0
    for module in model.modules():
        if not _eligible(module, kernel):
            continue
        lin = cast(_RoutedLinear, module)  # an nn.Linear (``_eligible``), about to get the routed attributes
        w = lin.weight
        key = (lin.in_features, lin.out_features, w.dtype)
        if max_rows is not None:  # forced: the kernel where it has this dtype, else oneDNN
            forced = ANY if max_rows < 0 else max_rows
            limit, onednn_limit = (forced, 0) if _has_kernel(kernel, w.dtype) else (0, forced)
        elif key not in limits:
            cached = cache.get(key) if cache is not None else None
            cached_onednn = cache.get(key, "onednn") if cache is not None else None
            limit = cached if cached is not None else calibrate(kernel, *key) if _has_kernel(kernel, w.dtype) else 0
            onednn_limit = cached_onednn if cached_onednn is not None else calibrate_onednn(*key, after=limit)
            if cache is not None and (cached is None or cached_onednn is None):
                cache.put(key, limit)
                cache.put(key, onednn_limit, "onednn")
            limits[key] = (limit, onednn_limit)
            log.info(
                "CPU linear, %s %dx%d: our kernel up to %s rows, then %s%s",
                str(w.dtype)[6:],
                lin.in_features,
                lin.out_features,
                "any number of" if limit == ANY else limit,
                "torch"
                if onednn_limit == 0
                else f"packed oneDNN up to {'any number of' if onednn_limit == ANY else onednn_limit} rows, then torch",
                "" if cached is None or cached_onednn is None else " (calibrated before, cached)",
            )
        else:
            limit, onednn_limit = limits[key]
        if limit == 0 and onednn_limit == 0:
            continue
        with torch.no_grad():
            if limit:
                lin._batchery_linear, _ = _kernel_fn(kernel, w.detach())
            else:  # no kernel rows: only an empty input (0 rows) reaches this, and torch takes it
                lin._batchery_linear = functools.partial(_torch_linear, lin)
            # a copy in oneDNN's layout: a layer routed to it holds its weight twice
            lin._batchery_onednn = _onednn_fn(lin.weight.detach().contiguous()) if onednn_limit else None
        lin._batchery_onednn_rows = onednn_limit if lin._batchery_onednn is not None else 0
        # a per-instance forward is how a torch module is rerouted without swapping its class
        lin.forward = types.MethodType(_forward, lin)  # type: ignore[method-assign]  # nn.Module declares forward a method
        lin._batchery_kernel = kernel
        lin._batchery_max_rows = limit
        count += 1
    if cache is not None and cache.dirty:
        if cache.busy is None:  # quiet at the start; was it while this calibrated?
            cache.busy = _others_busy_since(sample)
        if cache.busy is not None:
            log.warning("CPU kernels calibrated while %s: kept until a start on a quiet machine redoes it", cache.busy)
        cache.save()
    if count:
        log.info("%d linear layers run on the C++ CPU kernels", count)
    if count and (one_pass if one_pass is not None else fused_llama.installed(model)):
        fused = _install_gate_up(model, kernel)
        if fused:
            log.info("%d MLPs compute SiLU(gate) * up in one pass of our bf16 kernel", fused)
        fused = _install_qkv(model, kernel)
        if fused:
            log.info("%d attention layers compute q, k and v in one pass of our kernel", fused)
    return count


def _install_gate_up(model: torch.nn.Module, kernel: types.ModuleType) -> int:
    """Give each MLP whose ``gate_proj`` and ``up_proj`` run on our bf16 kernels a ``_batchery_gate_up``: both
    projections and SiLU(gate) * up in one pass over a weight that interleaves them (one more copy of the two), bit
    for bit what the two projections and ``cpu_fused.fused_silu_mul`` give. The fused decoder layers
    (``fused_llama``) call it: neither projection's output is written and read back, the product is computed while
    the sums are still in registers, and a step makes one call where it made three.

    - On AMX (``pack_amx_gate_up``, ``linear_amx_silu``): on the 2-core AMX Xeon, SmolLM2's
      576 -> 1536 pair with the SiLU, 30 layers' weights in turn: 1.05-1.15x the two AMX projections and the
      separate SiLU at 17-256 rows, 1.07x oneDNN's at 1024 rows (``fused_silu_mul`` alone takes about 1 ms there).
    - With AVX512-BF16 (``pack_bf16_gate_up``, ``linear_bf16_silu``: the vdpbf16ps tile writing the product).

    Either runs up to the row count both projections were calibrated to run on the kernel (any, where it always
    won); beyond it the two projections and the separate SiLU, as without it."""
    amx = hasattr(kernel, "linear_amx_silu")
    vdp = hasattr(kernel, "linear_bf16_silu") and kernel.has_bf16_silu()
    count = 0
    for module in model.modules():
        gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
        if not isinstance(gate, torch.nn.Linear) or not isinstance(up, torch.nn.Linear):
            continue
        if gate.bias is not None or up.bias is not None or gate.weight.shape != up.weight.shape:
            continue
        rows = min(getattr(lin, "_batchery_max_rows", 0) for lin in (gate, up))
        if not rows or gate.weight.dtype != torch.bfloat16:
            continue
        on_amx = [uses_amx(kernel, lin.weight) for lin in (gate, up)]
        if amx and all(on_amx):
            weight, run = kernel.pack_amx_gate_up(gate.weight.detach(), up.weight.detach()), kernel.linear_amx_silu
        elif vdp and not any(on_amx) and gate.out_features % 32 == 0:
            weight, run = kernel.pack_bf16_gate_up(gate.weight.detach(), up.weight.detach()), kernel.linear_bf16_silu
        else:
            continue

        def gate_up(
            x: torch.Tensor,
            weight: torch.Tensor = weight,
            run: Callable[..., torch.Tensor] = run,
            rows: int = rows,
            gate: torch.nn.Module = gate,
            up: torch.nn.Module = up,
        ) -> torch.Tensor:
            if x.numel() // x.shape[-1] <= rows:
                return run(x, weight)
            return kernel.fused_silu_mul(gate(x).contiguous(), up(x).contiguous())

        module._batchery_gate_up = gate_up
        count += 1
    return count


def _install_qkv(model: torch.nn.Module, kernel: types.ModuleType) -> int:
    """Give each attention module whose ``q_proj``, ``k_proj`` and ``v_proj`` run on our kernel (the same one: AMX or
    not) a ``_batchery_qkv``: x -> (q, k, v), one pass over a copy of the three weights stacked (one more copy of
    them), column for column what the three projections give. The fused decoder layers (``fused_llama``) call it: one
    call and one pass over x where a step made three, and the narrow k and v projections (SmolLM2: 192 columns, three
    panels for two threads) no longer run alone. Up to ``QKV_MAX_ROWS`` rows and the row count all three were
    calibrated to run on the kernel; beyond, the three projections. On the Zen 5 EPYC, SmolLM2's 30 layers in bf16:
    1.45 against 2.45 ms at 1 row, 5.35 against 6.63 at 57, 12.1 against 13.5 at 256, but 26.8 against 23.6 at 512
    and 77 against 67 at 1024 (fp32 alike: 156 against 133 ms at 1024), hence the cap."""
    count = 0
    for module in model.modules():
        lins = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if not all(isinstance(lin, torch.nn.Linear) for lin in lins):
            continue
        q, k, v = cast(list[torch.nn.Linear], lins)
        rows = min([QKV_MAX_ROWS] + [getattr(lin, "_batchery_max_rows", 0) for lin in (q, k, v)])
        if not rows or len({(lin.in_features, lin.weight.dtype, lin.bias is None) for lin in (q, k, v)}) != 1:
            continue
        with torch.no_grad():
            w = torch.cat([q.weight, k.weight, v.weight]).detach().contiguous()
            if len({uses_amx(kernel, t) for t in (q.weight, k.weight, v.weight, w)}) != 1:
                continue
            run, _ = _kernel_fn(kernel, w)
            bias = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias]).detach()
        sizes = [q.out_features, k.out_features, v.out_features]

        def qkv(
            x: torch.Tensor,
            run: KernelLinear = run,
            bias: torch.Tensor | None = bias,
            sizes: list[int] = sizes,
            rows: int = rows,
            projections: tuple[torch.nn.Module, ...] = (q, k, v),
        ) -> tuple[torch.Tensor, ...]:
            if x.numel() // x.shape[-1] <= rows:
                return tuple(run(x, bias).split(sizes, dim=-1))
            return tuple(lin(x) for lin in projections)

        setattr(module, "_batchery_qkv", qkv)  # noqa: B010  (nn.Module types its attributes as tensors or modules)
        count += 1
    return count
