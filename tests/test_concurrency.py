"""20 threads submitting and listing at once: no error reaches a client (SQLite and PostgreSQL)."""

from __future__ import annotations

import threading
from collections import Counter

import httpx

from service.config import Settings
from tests.conftest import LiveServer
from tests.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id


def test_twenty_threads_submit_list_and_cancel(live_server: LiveServer, settings: Settings) -> None:
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as admin:
        register_node(admin, create_token(admin, "worker"), "n1", units=2)
        users = [create_token(admin, "user", f"u{i}") for i in range(4)]
        datasets = {}
        for u in users:
            uid = token_id(admin, u)
            datasets[u] = (insert_dataset(settings, uid), insert_dataset(settings, uid))

    statuses: Counter[int] = Counter()
    errors: list[str] = []
    lock = threading.Lock()
    per_thread = 6

    def worker(i: int) -> None:
        token = users[i % len(users)]
        train, val = datasets[token]
        with httpx.Client(base_url=live_server.url, headers=auth(token), timeout=60) as c:
            for k in range(per_thread):
                r = c.post("/v1/jobs", json=job_spec(train, val, name=f"t{i}-{k}"))
                listing = c.get("/v1/jobs", params={"limit": 5})
                codes = [r.status_code, listing.status_code]
                if k % 3 == 0 and r.status_code == 201:
                    codes.append(c.post(f"/v1/jobs/{r.json()['id']}/cancel").status_code)
                with lock:
                    statuses.update(codes)
                    if any(code >= 400 for code in codes):
                        errors.append(f"{codes} {r.text[:200]}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert statuses[201] == 20 * per_thread
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as admin:
        seen, cursor = [], None
        while True:
            page = admin.get(
                "/v1/jobs", params={"limit": 37, **({"cursor": cursor} if cursor else {})}
            ).json()
            seen += page["items"]
            cursor = page["next_cursor"]
            if not cursor:
                break
    assert len(seen) == len({j["id"] for j in seen}) == 20 * per_thread
    # Cancelled at once when still queued, or cancelling if the scheduler had placed it already.
    by_status = Counter(j["status"] for j in seen)
    assert by_status["cancelled"] + by_status["cancelling"] == 20 * 2
