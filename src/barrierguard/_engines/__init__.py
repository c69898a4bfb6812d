"""Detection engines: each installs global hooks and hands syncs to the hub."""
