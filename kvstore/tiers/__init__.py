"""Storage tiers: memory slabs (hot/warm) and the persistent disk tier."""
