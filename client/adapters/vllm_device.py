"""How the vLLM connector's worker moves blocks between the paged cache and host staging, on
whatever device the cache lives.

On a GPU a save gathers a layer's blocks into pinned host staging with a non-blocking copy on a
side stream, after an event that marks the forward's writes, and hands the saver thread that
layer's completion event: ``save_kv_layer`` never waits for a copy. A load copies each layer's
rows from pinned staging to the device and scatters them into the cache on the side stream, one
event per layer; the forward's ``wait_for_layer_load`` makes its own stream wait on that event
(not the host). On the CPU there are no streams: the same calls copy plainly, on the calling
thread, so the CPU tests run this code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore.client.adapters.vllm_layouts import BlockViews


class DeviceCopies:
    """The copies of one cache's device.

    Args:
        device: the cache's device (``cpu`` or ``cuda:N``).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_gpu = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.on_gpu else None

    def host_buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Zeroed host staging (pinned where a GPU copies from or into it, so that its copies
        can be asynchronous)."""
        return torch.zeros(shape, dtype=torch.uint8, pin_memory=self.on_gpu)

    def start_save(
        self,
        views: BlockViews,
        layer: int,
        planes: torch.Tensor,
        runs: Sequence[tuple[int, int, int]],
    ) -> Callable[[], None]:
        """Start gathering blocks of ``layer`` into ``planes`` (see :meth:`BlockViews.gather`).

        Returns:
            What the saver thread calls before the rows may be read: on a GPU it waits for the
            layer's copy event; on the CPU it is the gather itself.
        """
        if self._stream is None:

            def gather() -> None:
                # Staging made inside the forward's inference mode may only be written there.
                with torch.inference_mode():
                    views.gather(layer, planes, runs)

            return gather
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self.device))
        done = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(written)
            # Block by block: one block's row in staging is contiguous pinned memory, so each
            # copy is asynchronous (a run of rows is strided, which torch would stage through
            # pageable memory, synchronously).
            per_block = [(s + i, d + i, 1) for s, d, n in runs for i in range(n)]
            views.gather(layer, planes, per_block, non_blocking=True)
            done.record(self._stream)
        return done.synchronize

    def load_layer(
        self,
        views: BlockViews,
        layer: int,
        planes: torch.Tensor,
        rows_to_blocks: Sequence[tuple[int, int]],
    ) -> Any:
        """Copy staging rows of ``layer`` (``planes``: ``[rows, 2, block_size, heads,
        head_dim]``, host) into their blocks of a GPU cache, on the side stream.

        Returns:
            The layer's completion event, for :meth:`wait`.
        """
        assert self._stream is not None, "load_layer is the GPU path; the CPU copies with numpy"
        dst = views.layers[layer]
        with torch.cuda.stream(self._stream):
            # A row's layer is contiguous pinned memory: each copy is asynchronous.
            for row, block in rows_to_blocks:
                dst[block].copy_(planes[row], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return done

    def wait(self, event: Any) -> None:
        """Make the caller's current stream wait for ``event`` (no host wait); None: nothing."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def drain(self) -> None:
        """Wait (on the host) until every copy started here is over, before staging is reused."""
        if self._stream is not None:
            self._stream.synchronize()
