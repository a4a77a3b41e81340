-- unlock: release the job's expire lock ({job}:expiring) by compare-and-delete (JobStore.expire).
-- KEYS: lock
-- ARGV: token
-- Returns: 1 if the lock was deleted, else 0.
-- Promises: atomic: deletes the lock only if it is still ours (it may have lapsed and been taken by another).
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
