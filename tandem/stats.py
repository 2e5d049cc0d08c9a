"""The SDK's name for the per-request statistics type the dispatcher and the SDK share
(common/stats.py)."""

from common.stats import RequestStats, Stats

__all__ = ["Stats", "RequestStats"]
