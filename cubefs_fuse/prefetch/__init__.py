"""ai_prefetch: datasets, jobs, epoch plans, the prefetch scheduler and hit accounting."""
