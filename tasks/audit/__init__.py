"""Gates (Great Expectations suites), their reports and Data Docs, and the run's audit report."""
