"""A serving API process freezes what start-up made out of the full garbage collections, and
spaces those out (service/api/app.py: freeze_heap); an app made by the tests does not."""

from __future__ import annotations

import gc

from fastapi.testclient import TestClient

from service.api.app import GC_FULL_EVERY, create_app
from service.config import Settings


def test_a_serving_app_freezes_its_start_up_heap_and_spaces_out_full_collections(settings: Settings) -> None:
    threshold = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    try:
        with TestClient(create_app(settings)) as client:
            assert client.get("/healthz").status_code == 200
            assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold
        with TestClient(create_app(settings, freeze=True)) as client:
            assert client.get("/healthz").status_code == 200
            # Start-up's objects (modules, routes, the OpenAPI schema) are frozen: hundreds of
            # thousands of them, which a full collection no longer walks.
            assert gc.get_freeze_count() > 100_000, gc.get_freeze_count()
            assert gc.get_threshold() == (threshold[0], threshold[1], GC_FULL_EVERY)
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
