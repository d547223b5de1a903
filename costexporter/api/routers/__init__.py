"""One router per resource: health, jobs, allocation."""
