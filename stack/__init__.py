"""The top floor: what deploys and runs Tandem, above the services, the SDK and the gateway.

The `tandem` command line (stack/cli.py), the local launcher and supervisor (stack/launcher.py),
the in-process stack (stack/inprocess.py), the WAN emulator (stack/wan.py, stack/wan_cli.py),
the observability helpers (stack/observability.py), CURVE key files (stack/keys.py) and the
resource plan with each service's own settings (stack/plan.py). This package may import every
other one; nothing below it imports it.
"""
