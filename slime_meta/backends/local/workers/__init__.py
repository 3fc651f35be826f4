"""The embedded workers behind sglang-router: the pools a run starts (`pools`, the `--grader local` pool in
`grader`), the process group (`launcher`, `processes`, `supervisor`), the weight push (`weight_sync`), where the
workers spent each step (`engine_time`)."""
