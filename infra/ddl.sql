-- gpupool's ClickHouse schema. Applied idempotently at start by infra/clickhouse.py.
-- The raw mirror is keyed by Kafka coordinates (topic, partition, offset); the ledger tables by event id, because a
-- scheduler that re-runs after a crash re-emits the same event ids at new offsets. ReplacingMergeTree collapses a
-- record written twice (queries use FINAL), and non_replicated_deduplication_window lets non-replicated MergeTree
-- honour the sink's offset-derived insert_deduplication_token, so a retried batch is not even written twice.
CREATE DATABASE IF NOT EXISTS gpupool;

-- Every fact the sink consumed, as it was on the wire.
CREATE TABLE IF NOT EXISTS gpupool.events (
    topic LowCardinality(String), partition UInt16, offset UInt64,
    event_id String, kind LowCardinality(String), source String, seq UInt64,
    event_time_ms UInt64,
    event_time DateTime64(3, 'UTC') MATERIALIZED fromUnixTimestamp64Milli(toInt64(event_time_ms), 'UTC'), tenant String, job_id String, node String, command_id String,
    payload String
) ENGINE = ReplacingMergeTree ORDER BY (topic, partition, offset)
SETTINGS non_replicated_deduplication_window = 100000;

-- GPU time, accrued by the scheduler's fold on event times (never the sink's clock).
CREATE TABLE IF NOT EXISTS gpupool.usage (
    topic LowCardinality(String), partition UInt16, offset UInt64, event_id String,
    tenant String, project String, job_id String, tier LowCardinality(String), node String,
    gpu_model LowCardinality(String), datacenter LowCardinality(String),
    start_ms UInt64, end_ms UInt64, gpu_milli UInt32, gpu_milli_ms UInt64, borrowed Bool
) ENGINE = ReplacingMergeTree ORDER BY (tenant, event_id)
SETTINGS non_replicated_deduplication_window = 100000;

-- Quota ledger changes: set, changed, borrowed, returned.
CREATE TABLE IF NOT EXISTS gpupool.quota_events (
    topic LowCardinality(String), partition UInt16, offset UInt64, event_id String,
    event_time_ms UInt64,
    event_time DateTime64(3, 'UTC') MATERIALIZED fromUnixTimestamp64Milli(toInt64(event_time_ms), 'UTC'), kind LowCardinality(String), tenant String, project String, job_id String,
    quota_milli Int64, used_milli Int64, borrowed_milli Int64, milli Int64, overcommit_pct UInt16
) ENGINE = ReplacingMergeTree ORDER BY (tenant, event_id)
SETTINGS non_replicated_deduplication_window = 100000;
-- added with memory quotas and reservations; idempotent for stores made before
ALTER TABLE gpupool.quota_events ADD COLUMN IF NOT EXISTS reserved_milli Int64 DEFAULT 0;
ALTER TABLE gpupool.quota_events ADD COLUMN IF NOT EXISTS quota_memory_mib Int64 DEFAULT 0;
ALTER TABLE gpupool.quota_events ADD COLUMN IF NOT EXISTS used_memory_mib Int64 DEFAULT 0;

-- added with usage ticks and one unit for quota and bill (docs/billing.md): the compute units held, reserved
-- in-quota work, and the run (attempt) an interval bills
ALTER TABLE gpupool.usage ADD COLUMN IF NOT EXISTS cu_milli UInt64 DEFAULT 0;
ALTER TABLE gpupool.usage ADD COLUMN IF NOT EXISTS cu_milli_ms UInt64 DEFAULT 0;
ALTER TABLE gpupool.usage ADD COLUMN IF NOT EXISTS reserved Bool DEFAULT false;
ALTER TABLE gpupool.usage ADD COLUMN IF NOT EXISTS attempt UInt32 DEFAULT 0;

-- added with authenticated principals (docs/security.md): who stated a request, and the time its client claimed
-- (-1: none; the event time is the broker's)
ALTER TABLE gpupool.events ADD COLUMN IF NOT EXISTS actor String DEFAULT '';
ALTER TABLE gpupool.events ADD COLUMN IF NOT EXISTS claimed_time_ms Int64 DEFAULT -1;
ALTER TABLE gpupool.quota_events ADD COLUMN IF NOT EXISTS actor String DEFAULT '';
-- the quota.set a quota.rejected answers (its event id)
ALTER TABLE gpupool.quota_events ADD COLUMN IF NOT EXISTS answers String DEFAULT '';

-- Scheduler decisions (placement, preemption, resize, migration, release, pending, rejection) with their reasons.
CREATE TABLE IF NOT EXISTS gpupool.scheduling (
    topic LowCardinality(String), partition UInt16, offset UInt64, event_id String,
    event_time_ms UInt64,
    event_time DateTime64(3, 'UTC') MATERIALIZED fromUnixTimestamp64Milli(toInt64(event_time_ms), 'UTC'), kind LowCardinality(String), command_id String, job_id String,
    tenant String, node String, reasons String
) ENGINE = ReplacingMergeTree ORDER BY (job_id, event_id)
SETTINGS non_replicated_deduplication_window = 100000;

-- What the sink is about to write, per partition: recorded before the data. After a crash mid-batch the restarted
-- sink cuts its first batch to exactly this range, so the redelivered records get their original deduplication token
-- even when the consumer hands them over with other batch boundaries.
CREATE TABLE IF NOT EXISTS gpupool.sink_intent (
    topic LowCardinality(String), partition UInt16, first_offset UInt64, last_offset UInt64
) ENGINE = ReplacingMergeTree(last_offset) ORDER BY (topic, partition);

-- Where the sink is, per partition: written after the data it covers is acknowledged.
CREATE TABLE IF NOT EXISTS gpupool.sink_progress (
    topic LowCardinality(String), partition UInt16, last_offset UInt64
) ENGINE = ReplacingMergeTree(last_offset) ORDER BY (topic, partition);

-- ---------------------------------------------------------------- billing (docs/billing.md)
-- Prices per GPU-hour in micro-units of the billing currency (1 unit = 1000000), by card model, datacenter,
-- time-of-day band, tier and whether the GPU time was borrowed beyond quota. '*' in datacenter, tod_band or tier
-- matches any value; the row with the latest valid_from not after the usage's end applies. Defaults: docs/billing.md.
CREATE TABLE IF NOT EXISTS gpupool.price_book (
    gpu_model LowCardinality(String), datacenter LowCardinality(String), tod_band LowCardinality(String),
    tier LowCardinality(String), borrowed Bool, micro_per_gpu_hour UInt64,
    valid_from DateTime64(3, 'UTC')
) ENGINE = ReplacingMergeTree ORDER BY (gpu_model, datacenter, tod_band, tier, borrowed, valid_from);

-- added with prices as events (price.set on the ledger, written by operators through the gateway)
ALTER TABLE gpupool.price_book ADD COLUMN IF NOT EXISTS event_id String DEFAULT '';
ALTER TABLE gpupool.price_book ADD COLUMN IF NOT EXISTS actor String DEFAULT '';
-- added with currencies (docs/billing.md "Currency"): the ISO 4217 code of the price; rows from before were USD
ALTER TABLE gpupool.price_book ADD COLUMN IF NOT EXISTS currency LowCardinality(String) DEFAULT 'USD';

-- Daily rollup of the bill for dashboards, fed by every insert into gpupool.usage. The bill of record is
-- gpupool.usage FINAL: a usage event re-emitted at a new offset after a scheduler crash is collapsed there but
-- counted twice here. Query with sum() ... GROUP BY (SummingMergeTree merges in the background).
CREATE MATERIALIZED VIEW IF NOT EXISTS gpupool.usage_daily
ENGINE = SummingMergeTree ORDER BY (day, tenant, project, gpu_model, borrowed)
SETTINGS non_replicated_deduplication_window = 100000
AS SELECT toDate(fromUnixTimestamp64Milli(toInt64(end_ms), 'UTC')) AS day, tenant, project, gpu_model, borrowed,
          sum(gpu_milli_ms) AS gpu_milli_ms, count() AS intervals
FROM gpupool.usage GROUP BY day, tenant, project, gpu_model, borrowed;

-- ---------------------------------------------------------------- telemetry history (docs/observability.md)
-- One row per card (or MIG instance) and minute of log time, downsampled by the worker's fold
-- (streams/telemetry_history.py) from gpupool.telemetry and written by the sink from gpupool.telemetry-minutes.
-- A minute re-emitted after a worker restart (fewer samples: part of it was read before) is collapsed to the row with
-- the most samples: query with FINAL. The job arrays say which jobs the card's samples named and each one's part of
-- its utilization (permille of the card) and memory. Kept 30 days, like the topic.
CREATE TABLE IF NOT EXISTS gpupool.telemetry_minutes (
    minute_ms UInt64,
    minute DateTime('UTC') MATERIALIZED toDateTime(intDiv(minute_ms, 1000), 'UTC'),
    node String, datacenter LowCardinality(String), gpu_uuid String, mig_uuid String,
    gpu_model LowCardinality(String), samples UInt32,
    util_mean_permille UInt16, util_max_pct UInt8, mem_used_mean_mib UInt64, mem_used_max_mib UInt64,
    mem_total_mib UInt64, temperature_mean_c Int16, temperature_max_c Int16, power_mean_mw UInt64,
    power_max_mw UInt64, ecc_corrected UInt64, ecc_uncorrected UInt64, xid_errors Array(UInt32),
    job_ids Array(String), job_tenants Array(String), job_tiers Array(String), job_samples Array(UInt32),
    job_util_permille Array(UInt32), job_mem_mib Array(UInt64), event_id String
) ENGINE = ReplacingMergeTree(samples) ORDER BY (node, gpu_uuid, mig_uuid, minute_ms)
TTL minute + INTERVAL 30 DAY
SETTINGS non_replicated_deduplication_window = 100000;

-- The same minutes per job on the card: tenant, tier and workload (inference, or training: the online-training and
-- offline tiers), with the job's part of the card's utilization and memory; idle cards have no row here.
CREATE VIEW IF NOT EXISTS gpupool.telemetry_by_job AS
SELECT minute_ms, minute, node, datacenter, gpu_uuid, mig_uuid, gpu_model, job_id, tenant, tier,
       multiIf(tier = 'inference', 'inference', tier = '', 'unknown', 'training') AS workload,
       job_samples AS samples, job_util_permille AS util_permille, job_mem_mib AS mem_used_mib
FROM gpupool.telemetry_minutes FINAL
ARRAY JOIN job_ids AS job_id, job_tenants AS tenant, job_tiers AS tier, job_samples, job_util_permille, job_mem_mib;

-- The pool at the end of each minute of log time (pool.minute from the worker): allocation, fragmentation, queue.
CREATE TABLE IF NOT EXISTS gpupool.pool_minutes (
    minute_ms UInt64,
    minute DateTime('UTC') MATERIALIZED toDateTime(intDiv(minute_ms, 1000), 'UTC'),
    worker String, capacity_milli UInt64, allocated_milli UInt64, free_milli UInt64, fragmentation_milli UInt64,
    allocated_milli_by_model Map(String, UInt64), capacity_milli_by_model Map(String, UInt64),
    queue_by_tier Map(String, UInt64), oldest_wait_ms_by_tier Map(String, UInt64), event_id String
) ENGINE = ReplacingMergeTree ORDER BY (worker, minute_ms)
TTL minute + INTERVAL 30 DAY
SETTINGS non_replicated_deduplication_window = 100000;

-- ---------------------------------------------------------------- programs' output (docs/jobs.md, "Logs")
-- A database of its own: what programs print is theirs and their tenants', not the pool's record, so ad-hoc SQL
-- (infra/sql_guard.py) never reaches it; /api/logs serves it to the job's tenant and to operators only.
CREATE DATABASE IF NOT EXISTS gpupool_logs;

-- One row per piece of a run's stdout or stderr (job.log), as the node relay forwarded it to gpupool.job-logs: only
-- pieces of jobs placed on the node that wrote them. A piece relayed twice (the relay re-run after a crash) has one
-- key (job, attempt, part, stream, seq) and is collapsed to the copy relayed first (`keep`: the smallest offset),
-- so a reader's cursor (the offset: one partition holds a job's pieces, in the order they were relayed) never
-- moves back: query with FINAL. Kept GPUPOOL_LOG_RETENTION_DAYS (default 7; the sink sets the TTL at start) from
-- when it was stored: a node's clock, far off, neither expires its pieces at once nor keeps them for ever.
CREATE TABLE IF NOT EXISTS gpupool_logs.job_logs (
    topic LowCardinality(String), partition UInt16, offset UInt64, event_id String,
    event_time_ms UInt64,
    event_time DateTime('UTC') MATERIALIZED toDateTime(intDiv(event_time_ms, 1000), 'UTC'),
    tenant String, job_id String, node String, attempt UInt32, part UInt32, stream LowCardinality(String),
    seq UInt64, text String, dropped_bytes UInt64, final Bool,
    keep UInt64 MATERIALIZED bitNot(offset), stored DateTime('UTC') DEFAULT now()
) ENGINE = ReplacingMergeTree(keep) ORDER BY (job_id, attempt, part, stream, seq)
TTL stored + INTERVAL 7 DAY
SETTINGS non_replicated_deduplication_window = 100000;

-- Each job as the job view's fold decides it (streams/folds/job_view.py): its state, node, run, counts and reasons,
-- one row per change the fold made, from the job view's changelog (gpupool-job-view-changelog). `version` is the
-- change's changelog offset: FINAL keeps the latest, so a redelivered or replayed change changes nothing. The API,
-- the CLI and the dashboard read a job's state here and nowhere else (docs/jobs.md, "A job's state").
CREATE TABLE IF NOT EXISTS gpupool.jobs (
    job_id String, tenant String, project String, tier LowCardinality(String), compute_milli UInt64,
    gpu_memory_mib UInt64, retries UInt32, state LowCardinality(String), node String, command_id String,
    started_ms UInt64, ended_ms UInt64, progress_ms UInt64, checkpoint String, preemptions UInt32,
    migrations UInt32, interruptions UInt32, failures UInt32, last_exit String, retry_at_ms UInt64,
    reasons String, version UInt64
) ENGINE = ReplacingMergeTree(version) ORDER BY job_id
SETTINGS non_replicated_deduplication_window = 100000;
