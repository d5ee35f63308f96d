"""KV tiers under the block pool: host memory and a disk directory, keyed by chained block hash
within a keyspace of the weights (see tiers.py for how they fit together)."""
