"""One run's machinery: set-up shared by the entry points, life cycle (shutdown, preemption,
watchdog), metrics and monitors, and the step's memory budget."""
