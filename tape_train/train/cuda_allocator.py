"""PyTorch's CUDA caching allocator on the training path: expandable segments, and its retries.

Near capacity the caching allocator may find no cached block that fits a request and see
``cudaMalloc`` fail; it then frees its unused cached segments (``cudaFree`` synchronises the
device) and tries again. Each such retry (``torch.cuda.memory_stats()["num_alloc_retries"]``)
idles the device while the host waits. Fixed-size segments fragment: the blocks a step frees
are scattered over segments that the next step's request sizes do not fit. With expandable
segments (``expandable_segments:True``) the allocator maps more physical memory into one
growing virtual range instead, so freed memory stays usable for any size.

When the setting takes effect (torch 2.13, c10's ``AcceleratorAllocatorConfig`` and
``CUDACachingAllocator``): the allocator reads it each time it creates a segment, so a setting
made at run time (``torch.cuda.memory._set_allocator_settings``) governs every segment created
after it, and segments that exist keep their kind. ``PYTORCH_CUDA_ALLOC_CONF`` (then
``PYTORCH_ALLOC_CONF``) is read once, when the configuration is first used, which in a process
that has imported torch may have happened already. So the trainer does not go through the
environment: each CUDA rank makes the call right after choosing its device
(``tape_train.train.distributed.init_distributed``), before NCCL or the model allocate
anything. A variable the user exported is their setting: it is left alone and wins over
``train.cuda_expandable_segments``. On CPU nothing is touched. On a platform without CUDA's
virtual-memory driver API torch warns once and keeps fixed-size segments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

CONFIG_KEY = "train.cuda_expandable_segments"
# torch reads the first of these that is set (an empty value counts: it means its defaults).
ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


@dataclass(frozen=True)
class AllocatorSetting:
    """The caching allocator's settings on a CUDA rank and where they came from.

    Attributes:
        settings: the settings string in force, as torch parses it (``""``: torch's defaults).
        source: where it came from: ``train.cuda_expandable_segments`` or the name of the
            environment variable.
        expandable: whether the settings ask for expandable segments.
        apply: what the trainer passes to torch at start-up; ``None``: nothing (the
            environment's setting, or torch's defaults).
        reserved_before_gib: CUDA memory the allocator had reserved when the setting was
            applied (segments created before it keep fixed sizes); 0 in a trainer's process.
    """

    settings: str
    source: str
    expandable: bool
    apply: str | None
    reserved_before_gib: float = 0.0

    def describe(self) -> str:
        """One log line: the setting in force and where it came from."""
        state = "expandable segments " + ("on" if self.expandable else "off")
        if self.source in ENV_VARS:
            line = (f"CUDA caching allocator: {self.source}={self.settings!r} from the "
                    f"environment, which wins over {CONFIG_KEY} ({state})")
        elif self.apply is not None:
            line = f"CUDA caching allocator: {self.settings} ({CONFIG_KEY}=true; {state})"
        else:
            line = f"CUDA caching allocator: torch's defaults ({CONFIG_KEY}=false; {state})"
        if self.reserved_before_gib > 0:
            line += (f"; {self.reserved_before_gib:.2f} GiB were reserved before it was set: "
                     f"those segments keep fixed sizes")
        return line

    def remedy(self) -> str | None:
        """How to turn expandable segments on; ``None`` when they are on."""
        if self.expandable:
            return None
        if self.source in ENV_VARS:
            return (f"add {EXPANDABLE} to {self.source} (exported in the environment, it wins "
                    f"over {CONFIG_KEY})")
        return f"set {CONFIG_KEY}=true (expandable segments, off now)"


def choose_allocator_setting(expandable_segments: bool,
                             environ: Mapping[str, str]) -> AllocatorSetting:
    """The decision, without side effects: the environment's setting if the user exported
    one (``ENV_VARS``, first set wins, as in torch), else expandable segments when
    ``expandable_segments`` (``train.cuda_expandable_segments``), else torch's defaults."""
    for name in ENV_VARS:
        if name in environ:
            value = environ[name]
            return AllocatorSetting(value, name, asks_for_expandable(value), None)
    if expandable_segments:
        return AllocatorSetting(EXPANDABLE, CONFIG_KEY, True, EXPANDABLE)
    return AllocatorSetting("", CONFIG_KEY, False, None)


def asks_for_expandable(settings: str) -> bool:
    """Whether an allocator settings string (``key:value,key:value``) turns expandable
    segments on; a key given twice counts as torch reads it, the last time."""
    found = False
    for item in settings.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            found = value.strip() == "True"  # torch accepts only True/False, capitalised
    return found


def configure_cuda_allocator(expandable_segments: bool, device: torch.device,
                             environ: Mapping[str, str] | None = None
                             ) -> AllocatorSetting | None:
    """Apply ``choose_allocator_setting`` on a CUDA rank, before its first allocation;
    ``None`` (and nothing touched) on any other device. Not undone by the trainer's
    ``close``: a process-wide setting that only shapes segments created later."""
    if device.type != "cuda":
        return None
    setting = choose_allocator_setting(expandable_segments,
                                       os.environ if environ is None else environ)
    if setting.apply is not None:
        reserved = torch.cuda.memory_reserved(device) / 2**30
        set_allocator_settings(setting.apply)
        if reserved > 0:
            setting = AllocatorSetting(setting.settings, setting.source, setting.expandable,
                                       setting.apply, reserved)
    return setting


def set_allocator_settings(settings: str) -> None:
    """torch's run-time call (the one place it is made; tests replace it). Through
    ``torch.cuda.memory._set_allocator_settings``, which every torch since 2.1 has (the C
    function it forwards to was renamed in between; GPU images carry older torch builds)."""
    torch.cuda.memory._set_allocator_settings(settings)


class RetryWatch:
    """Warns when the caching allocator's cumulative retry count has grown: one line per
    growth, naming the steps it grew in. While it keeps growing, the next line comes no sooner
    than ``first_gap`` steps later, then twice as many each time, and sums up the steps in
    between (a run that retries every step warns about log2(steps) times;
    ``mem/cuda_alloc_retries`` in metrics.jsonl has every count).

    Args:
        retries: the count when training starts (set-up's retries are no step's); ``None``
            off CUDA, where the watch says nothing.
        step: the last step done then.
        setting: the allocator setting in force (its remedy goes into the line).
        checkpointing: ``train.activation_checkpointing`` is on (not suggested then).
    """

    def __init__(self, retries: int | None, step: int, setting: AllocatorSetting | None,
                 checkpointing: bool = False, first_gap: int = 10) -> None:
        self.setting, self.checkpointing = setting, checkpointing
        self.reported = self.seen = retries  # counted in a warning / at the last check
        self.step = step                       # the last step checked
        self.grew: tuple[int, int] | None = None  # (first, last) step of unreported growth
        self.quiet_until, self.gap = step, first_gap

    def check(self, step: int, retries: int | None) -> str | None:
        """The warning for a logged ``step`` whose cumulative count is ``retries`` (``None``
        off CUDA); ``None`` when there is nothing (new) to say."""
        if retries is None or self.seen is None:
            return None
        if retries < self.seen:  # the counters were reset (reset_accumulated_memory_stats)
            self.reported = min(self.reported, retries)
        elif retries > self.seen:
            self.grew = (self.grew[0] if self.grew else self.step + 1, step)
        self.seen, self.step = retries, step
        if self.grew is None or step < self.quiet_until:
            return None
        (first, last), grown = self.grew, retries - self.reported
        steps = f"step {last}" if first == last else f"steps {first}-{last}"
        self.reported, self.grew = retries, None
        self.quiet_until, self.gap = step + self.gap, 2 * self.gap
        remedies = ["lower train.micro_batch_size"]
        if not self.checkpointing:
            remedies.append("set train.activation_checkpointing=true")
        extra = self.setting.remedy() if self.setting is not None else None
        if extra:
            remedies.append(extra)
        todo = (f"{', '.join(remedies[:-1])}, or {remedies[-1]}" if len(remedies) > 1
                else remedies[0])
        return (f"CUDA allocator: {grown} allocation retr{'y' if grown == 1 else 'ies'} in "
                f"{steps} ({retries} in this process): each freed the allocator's cached "
                f"memory and retried cudaMalloc, a device-wide synchronisation that idles the "
                f"device. The step is near the device's memory capacity: "
                f"{todo}. Next such warning at step {self.quiet_until} at the earliest")
