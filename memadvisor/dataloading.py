"""Data loading against the planned step: is the loader, not memory, what limits throughput?

:func:`advise_loader` times a few batches of the user's ``DataLoader`` as it is, then of
copies with other ``num_workers`` (and, with a card, ``pin_memory``), and sets the loader's
samples per second against the planned step's. The user's loader is only iterated; the
variants are new ``DataLoader`` objects over the same dataset, sampler and collate function.

What is measured:
    * ``first_batch_ms``: from ``iter(loader)`` to the first batch, worker start-up included.
      A loader without ``persistent_workers`` pays it again every epoch.
    * ``batch_ms``: the median time per batch after the first, the loader running alone. With
      ``num_workers > 0`` the workers load while the step computes, so the loader limits
      throughput only when its rate is below the step's; with ``num_workers=0`` loading and
      the step take turns, and every millisecond of loading adds to the step.
    * ``copy_ms`` (CUDA only): the batch's host-to-card copy, pinned or not.

Known limitations:
    * A few batches, timed on a busy machine, are noisy: the advice quotes medians and only
      recommends a change that is at least 20% faster.
    * An ``IterableDataset`` is replicated in every worker unless it shards itself; the
      timing is right, the data would repeat.
    * The loader runs alone here; in training it shares the CPU with the step's own threads.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from memadvisor.errors import BadInputError
from memadvisor.process_state import usable_cores
from memadvisor.schema.loader import LoaderAdvice, LoaderTrial
from memadvisor.workload import batch_size_of, tensor_leaves

__all__ = ["LoaderAdvice", "LoaderTrial", "advise_loader", "time_loader"]

_BETTER = 0.8  # a variant is recommended only when its time is at most this share of the current


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    """The arguments that rebuild ``loader`` over the same data, sampling and collation."""
    kwargs: dict[str, Any] = {
        "dataset": loader.dataset,
        "collate_fn": loader.collate_fn,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
    }
    if isinstance(loader.dataset, IterableDataset):
        kwargs.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_size is None:  # a batch sampler of the user's, or no batching
        kwargs["batch_sampler"] = loader.batch_sampler
    else:
        kwargs.update(
            batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last
        )
    return kwargs


def _variant(loader: DataLoader, num_workers: int, pin_memory: bool) -> DataLoader:
    kwargs = _loader_kwargs(loader)
    if num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor or 2
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    return DataLoader(num_workers=num_workers, pin_memory=pin_memory, **kwargs)


def time_loader(loader: DataLoader, *, batches: int = 5, copy_to_cuda: bool = False) -> LoaderTrial:
    """Time the first batch and ``batches`` more of ``loader``.

    Raises:
        BadInputError: the loader yields fewer than two batches.
    """
    started = time.perf_counter()
    it = iter(loader)
    times: list[float] = []
    copies: list[float] = []
    samples = 0
    first_ms = 0.0
    try:
        for i in range(batches + 1):
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            now = time.perf_counter()
            if i == 0:
                first_ms = (now - started) * 1e3
                samples = _samples(batch)
            else:
                times.append((now - t0) * 1e3)
            if copy_to_cuda:
                copies.append(_copy_ms(batch))
    finally:
        del it  # shuts its workers down
    if not times:
        raise BadInputError(
            f"The DataLoader yielded {len(times) + (first_ms > 0)} batch(es); timing it needs "
            "at least two. Pass a loader over more data."
        )
    return LoaderTrial(
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers,
        batches=len(times),
        first_batch_ms=first_ms,
        batch_ms=statistics.median(times),
        batch_ms_spread=(min(times), max(times)),
        copy_ms=statistics.median(copies) if copies else None,
        samples_per_batch=samples,
    )


def _samples(batch: Any) -> int:
    try:
        return batch_size_of(batch)
    except BadInputError:
        return 1


def _copy_ms(batch: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for t in tensor_leaves(batch):
        t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def advise_loader(
    loader: DataLoader,
    step_samples_per_s: float,
    *,
    step_measured: bool = True,
    cuda: bool = False,
    batches: int = 5,
    worker_counts: tuple[int, ...] | None = None,
) -> LoaderAdvice:
    """Time ``loader`` and its variants against a step that consumes ``step_samples_per_s``.

    Args:
        loader: the user's DataLoader; it is iterated, not changed.
        step_samples_per_s: the planned step's rate (the plan's measured samples/s).
        step_measured: whether that rate was measured (the words say so).
        cuda: the step runs on a card: time ``pin_memory`` and the host-to-card copy.
        batches: batches timed per configuration after the first.
        worker_counts: the ``num_workers`` values to try; default 0, 2 and 4 (at most the
            CPUs this process may use).

    Raises:
        BadInputError: ``loader`` is not a DataLoader, or yields fewer than two batches.
    """
    if not isinstance(loader, DataLoader):
        raise BadInputError(
            f"dataloader must be a torch.utils.data.DataLoader, but got {type(loader).__name__}."
        )
    cpus = usable_cores()
    if worker_counts is None:
        worker_counts = tuple(sorted({0, min(2, cpus), min(4, cpus)}))
    current = time_loader(loader, batches=batches, copy_to_cuda=cuda)
    variants = []
    for workers in worker_counts:
        for pin in (False, True) if cuda else (loader.pin_memory,):
            if (workers, pin) == (loader.num_workers, loader.pin_memory):
                continue
            trial = time_loader(_variant(loader, workers, pin), batches=batches, copy_to_cuda=cuda)
            variants.append(trial)
    return _advice(loader, current, variants, step_samples_per_s, step_measured, cuda)


def _cost_ms(trial: LoaderTrial) -> float:
    """What the step waits for per batch: the load, and the copy that is not overlapped."""
    return trial.batch_ms + (trial.copy_ms or 0.0)


def _advice(
    loader: DataLoader,
    current: LoaderTrial,
    variants: list[LoaderTrial],
    step_rate: float,
    step_measured: bool,
    cuda: bool,
) -> LoaderAdvice:
    how = "measured" if step_measured else "estimated"
    rate = current.samples_per_s
    limits = rate < step_rate
    sentences = [
        f"Your loader (num_workers={current.num_workers}, pin_memory={current.pin_memory}) "
        f"delivers {rate:,.0f} samples/s ({current.batch_ms:.1f} ms per batch of "
        f"{current.samples_per_batch}, median of {current.batches}); the planned step consumes "
        f"{step_rate:,.0f} samples/s ({how})."
    ]
    if limits:
        sentences.append("The loader, not memory, limits throughput: the step would wait for data.")
    elif current.num_workers == 0:
        share = current.samples_per_batch / step_rate * 1e3
        sentences.append(
            f"With num_workers=0 loading does not overlap the step: each batch adds "
            f"{current.batch_ms:.1f} ms to the step's {share:.1f} ms."
        )
    else:
        sentences.append("The loader keeps up with the step.")
    best = min(variants, key=_cost_ms, default=None)
    recommended: dict[str, Any] = {}
    if best is not None and _cost_ms(best) <= _BETTER * _cost_ms(current):
        if best.num_workers != current.num_workers:
            recommended["num_workers"] = best.num_workers
        if best.pin_memory != current.pin_memory:
            recommended["pin_memory"] = best.pin_memory
        sentences.append(
            f"Measured: num_workers={best.num_workers}, pin_memory={best.pin_memory} takes "
            f"{_cost_ms(best):.1f} ms per batch against {_cost_ms(current):.1f} ms now "
            f"({best.samples_per_s:,.0f} samples/s)."
        )
    workers = recommended.get("num_workers", current.num_workers)
    if workers > 0 and not loader.persistent_workers:
        starts = [t.first_batch_ms for t in (current, *variants) if t.num_workers == workers]
        recommended["persistent_workers"] = True
        sentences.append(
            f"persistent_workers=True keeps the {workers} workers between epochs; without it "
            f"each epoch starts them again (measured: {min(starts):.0f} ms to the first batch)."
        )
    if not cuda:
        sentences.append(
            "pin_memory only speeds host-to-card copies; this step runs without a card, so it "
            "was not timed."
        )
    snippet = ""
    if recommended:
        args = ", ".join(f"{k}={v!r}" for k, v in recommended.items())
        snippet = f"loader = DataLoader(dataset, batch_size={loader.batch_size}, {args})\n"
    return LoaderAdvice(
        current=current,
        variants=variants,
        step_samples_per_s=step_rate,
        step_measured=step_measured,
        limits_throughput=limits,
        recommended=recommended,
        sentences=sentences,
        snippet=snippet,
    )
