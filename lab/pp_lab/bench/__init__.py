"""The benchmarks behind benchmarks/ (operator throughput, codec profiles, end-to-end runs over throttled links)."""
