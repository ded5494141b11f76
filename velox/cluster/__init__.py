"""Several hosts sharing one Redis (VELOX_REDIS_URL): the rate-limit lease refresher (`leases`)."""
