"""The host-sync guard and collective counter, public in the package (``twinkle_megatron.testing.guards``);
re-exported for the tests."""

from twinkle_megatron.testing.guards import Guard, HostSyncError, count_collectives, forbid_host_sync, host_sync_free

__all__ = ["Guard", "HostSyncError", "count_collectives", "forbid_host_sync", "host_sync_free"]
