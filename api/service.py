"""`tandem serve api` / `python -m api.service`: the OpenAI-compatible gateway on uvicorn.

    tandem serve api --port 8000 --dispatcher tcp://127.0.0.1:5550
    TANDEM_API_PORT=8080 tandem serve api --config api.yaml

Settings: api/config.py (YAML < TANDEM_<FIELD> / TANDEM_API_<FIELD> < --field-name).
"""

from __future__ import annotations

import logging
import os
import sys

from common.config import load


def main(argv: list[str] | None = None) -> None:
    from api.config import ApiConfig  # noqa: PLC0415
    cfg = load(ApiConfig, "api", argv)
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s api %(levelname)s %(message)s")
    if cfg.cpus:
        from common import resources  # noqa: PLC0415
        os.sched_setaffinity(0, resources.parse_cpus(cfg.cpus))
    import uvicorn  # noqa: PLC0415

    from api.app import create_app  # noqa: PLC0415
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                access_log=cfg.log_level == "debug", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
