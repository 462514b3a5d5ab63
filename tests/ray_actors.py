"""Actor classes for the Ray tests; a module of their own so that Ray's workers can import them
(the tests put this directory on the workers' PYTHONPATH)."""
from __future__ import annotations

import os

from hf_paged.integrations.ray_data import PagedGenerator


class DiesOnce(PagedGenerator):
    """Kills its own process on the first batch holding row ``fail_index``, once per ``marker`` file:
    an actor crash mid-batch, which Ray must answer by restarting the actor and retrying the batch."""

    def __init__(self, model, *, marker: str, fail_index: int, **options):
        super().__init__(model, **options)
        self.marker, self.fail_index = marker, fail_index

    def __call__(self, batch: dict) -> dict:
        if self.fail_index in batch["i"]:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os._exit(1)
        return super().__call__(batch)
