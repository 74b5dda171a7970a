"""Flyte workflows and LaunchPlans only: fully_async_rl, eval_backfill, the scheduled continuation."""
