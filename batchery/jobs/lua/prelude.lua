-- prelude: the helper functions the job store's scripts share (batchery.jobs.store). The loader puts this file in
-- front of each script that calls them (batchery.jobs.lua.load(name, prelude=True)); it only defines functions.
-- KEYS, ARGV: none of its own. The job store calls every script that uses the prelude with the job's six keys:
--   job, results, running, pending, done (a bitmap: bit n set once line n has its record, kept after the record moves
--   to the file store) and runs (the list of the job's record files in the store); finish() also deletes KEYS[4] and
--   gives KEYS[5] and KEYS[6] the TTL when the calling script was given them.
-- Every timestamp is the Redis server's clock (TIME), never a caller's.
--   server_now()                    the server's time, 'seconds.microseconds'
--   finish(job, results, running, status, now, ttl)
--                                   the job ends: status, {status}_at and expires_at (now + ttl); the job hash and
--                                   its records get the TTL; the leases (and the ledger, KEYS[4]) are deleted
--   live_leases(running, now)       drops the leases whose deadline has passed; returns how many are left
--   inherit_ttl(key, job)           a key without a TTL gets the job's (a record written after the job ended)
--   recorded(line)                  whether the line has its record (its bit in KEYS[5], or a record in KEYS[2])
--   mark(line)                      sets the line's bit in KEYS[5] (its record is being written)
--   num(job, field)                 a numeric field of the job hash, 0 when missing
--   window_passed(job, now)         whether the job's completion window (window_ends_at) has ended
--   settle(job, results, running, status, ttl)
--                                   after a new record was counted: the last record of an in_progress job makes it
--                                   finalizing, the last lease of a cancelling one makes it cancelled; the status
--   expire_line(job, results, pending, line, record, now)
--                                   the line's batch_expired record, counted as failed (and expired_lines), once;
--                                   returns 1 if it was new, else 0
local function server_now()
  local t = redis.call('TIME')
  return string.format('%d.%06d', tonumber(t[1]), tonumber(t[2]))
end
local function finish(job, results, running, status, now, ttl)
  local expires = string.format('%.6f', tonumber(now) + tonumber(ttl))
  redis.call('HSET', job, 'status', status, status .. '_at', now, 'expires_at', expires)
  redis.call('EXPIRE', job, ttl)
  if redis.call('EXISTS', results) == 1 then redis.call('EXPIRE', results, ttl) end
  redis.call('DEL', running)
  if KEYS[4] then redis.call('DEL', KEYS[4]) end
  for i = 5, 6 do
    if KEYS[i] and redis.call('EXISTS', KEYS[i]) == 1 then redis.call('EXPIRE', KEYS[i], ttl) end
  end
end
local function live_leases(running, now)
  local leases = redis.call('HGETALL', running)
  for i = 1, #leases, 2 do
    if tonumber(leases[i + 1]) < tonumber(now) then redis.call('HDEL', running, leases[i]) end
  end
  return redis.call('HLEN', running)
end
local function inherit_ttl(key, job)
  if redis.call('TTL', key) < 0 then
    local ttl = redis.call('TTL', job)
    if ttl > 0 then redis.call('EXPIRE', key, ttl) end
  end
end
local function recorded(line)
  if KEYS[5] and redis.call('GETBIT', KEYS[5], line) == 1 then return true end
  return redis.call('HEXISTS', KEYS[2], line) == 1
end
local function mark(line)
  if KEYS[5] then
    redis.call('SETBIT', KEYS[5], line, 1)
    inherit_ttl(KEYS[5], KEYS[1])
  end
end
local function num(job, field)
  return tonumber(redis.call('HGET', job, field) or '0') or 0
end
local function window_passed(job, now)
  local ends = tonumber(redis.call('HGET', job, 'window_ends_at') or '')
  return ends ~= nil and tonumber(now) >= ends
end
-- after a new record was counted: the last record of an in_progress job makes it finalizing, the last lease of a
-- cancelling one makes it cancelled
local function settle(job, results, running, status, ttl)
  if status == 'in_progress' then
    if num(job, 'completed') + num(job, 'failed') >= num(job, 'total') then
      redis.call('HSET', job, 'status', 'finalizing', 'finalizing_at', server_now())
      return 'finalizing'
    end
  elseif status == 'cancelling' then
    local now = server_now()
    if live_leases(running, now) == 0 then
      finish(job, results, running, 'cancelled', now, ttl)
      return 'cancelled'
    end
  end
  return status
end
-- a line its job's completion window ended before it started: its batch_expired record, counted as failed, once
local function expire_line(job, results, pending, line, record, now)
  if recorded(line) then return 0 end
  mark(line)
  redis.call('HSET', results, line, record)
  redis.call('HDEL', pending, line)
  inherit_ttl(results, job)
  redis.call('HINCRBY', job, 'failed', 1)
  redis.call('HINCRBY', job, 'expired_lines', 1)
  redis.call('HSET', job, 'progress_at', now)
  return 1
end
