-- wrk script: POST the benchmark's chat request, then print one JSON line of results.
-- The body, path and extra headers come from the environment (set by benches/e2e/wrk.py),
-- so every target receives byte-for-byte the same request.
local function read_file(path)
  local fh = assert(io.open(path, "rb"))
  local data = fh:read("*a")
  fh:close()
  return data
end

wrk.method = "POST"
wrk.path = os.getenv("WRK_PATH") or "/v1/chat/completions"
wrk.body = read_file(os.getenv("WRK_BODY_FILE"))
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("WRK_API_KEY") or "sk-bench")
-- Extra request headers, one "Name: value" per line (benches/e2e/cache.py: Cache-Control).
for name, value in (os.getenv("WRK_HEADERS") or ""):gmatch("([^:\n]+):%s*([^\n]*)") do
  wrk.headers[name] = value
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"n":%d,"p50":%d,"p90":%d,"p99":%d,"p99.9":%d,"max":%d,"mean":%.1f,"stdev":%.1f}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    summary.requests, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max, latency.mean, latency.stdev))
end
