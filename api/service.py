"""`tandem serve api` / `python -m api.service`: the OpenAI-compatible gateway on uvicorn.

    tandem serve api --port 8000 --dispatcher tcp://127.0.0.1:5550
    TANDEM_API_PORT=8080 tandem serve api --config api.yaml
    tandem serve api --api-keys-file keys.txt          # Authorization: Bearer KEY required

Settings: api/config.py (YAML < TANDEM_<FIELD> / TANDEM_API_<FIELD> < --field-name).
"""

from __future__ import annotations

import logging
import os
import sys

from common.config import load


def merge_repeated(argv: list[str], flag: str) -> list[str]:
    """`--api-key A --api-key B` -> `--api-key A,B` (argparse would keep only the last)."""
    values, rest, it = [], [], iter(argv)
    for arg in it:
        if arg == flag:
            values.append(next(it, None))
        elif arg.startswith(flag + "="):
            values.append(arg[len(flag) + 1:])
        else:
            rest.append(arg)
    if any(not v or not v.strip() for v in values):
        # `--api-key "$KEY"` with KEY unset must not start an open API
        raise SystemExit(f"{flag} needs a key (an empty one would leave the API open)")
    return rest + [flag, ",".join(values)] if values else rest


def main(argv: list[str] | None = None) -> None:
    from api.config import ApiConfig
    argv = merge_repeated(sys.argv[1:] if argv is None else list(argv), "--api-key")
    cfg = load(ApiConfig, "api", argv)
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s api %(levelname)s %(message)s")
    if cfg.cpus:
        from common import resources
        os.sched_setaffinity(0, resources.parse_cpus(cfg.cpus))
    import uvicorn

    from api.app import create_app
    from api.auth import KeysError
    try:
        app = create_app(cfg)
    except KeysError as e:
        raise SystemExit(f"bad api setting: {e}") from None
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                access_log=cfg.log_level == "debug", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
