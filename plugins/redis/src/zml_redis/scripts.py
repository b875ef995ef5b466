"""The Lua scripts: each runs atomically in Redis, so a check and the write it guards are one step.

Time is Redis's own clock (``TIME``), never a client's: leases of processes on machines whose
clocks disagree still expire at the same moment for everyone. Lease scores are expiry times in
milliseconds.
"""

from __future__ import annotations

__all__ = ["ACQUIRE", "CORRUPT_MARK", "LOADS", "PUSH", "RELEASE", "REMOVE", "RENEW"]

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

ACQUIRE = _NOW + """
-- KEYS[1]: a node's lease set. ARGV: lease id, capacity, ttl (ms).
-- Drop expired leases, count, add if below capacity.
-- Returns the count held afterwards: > 0 granted, < 0 refused (minus the count held).
local ttl = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[2]) then
  return -held
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], 3 * ttl)
return held + 1
"""

RENEW = _NOW + """
-- KEYS[1]: a node's lease set. ARGV: ttl (ms), mode, lease ids...
-- mode 'XX' renews leases still present (an expired and purged one stays gone: its slot may
-- have been given to someone else); mode 'ADD' writes them all (after Redis came back empty).
local ttl = tonumber(ARGV[1])
local expiry = now + ttl
local n = 0
for i = 3, #ARGV do
  if ARGV[2] == 'XX' then
    n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', expiry, ARGV[i])
  else
    n = n + redis.call('ZADD', KEYS[1], expiry, ARGV[i])
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('PEXPIRE', KEYS[1], 3 * ttl)
end
return n
"""

RELEASE = _NOW + """
-- KEYS: lease sets. ARGV: channel, origin, then for each key: its capacity, a count n and n
-- lease ids. Deletes the leases; for each set that was full before, announces its new count
-- on the channel, so that other processes see the freed slots at once:
-- {"o": origin, "loads": {key: count}} (nothing is published when no set was full).
local loads = {}
local freed = false
local i = 3
for _, key in ipairs(KEYS) do
  local capacity = tonumber(ARGV[i])
  local n = tonumber(ARGV[i + 1])
  -- a key edited by hand into another type is skipped, so the others' leases still go
  if redis.call('TYPE', key)['ok'] == 'zset' then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    local before = redis.call('ZCARD', key)
    for j = i + 2, i + n + 1 do
      redis.call('ZREM', key, ARGV[j])
    end
    if before >= capacity then
      loads[key] = redis.call('ZCARD', key)
      freed = true
    end
  end
  i = i + n + 2
end
if freed then
  redis.call('PUBLISH', ARGV[1], cjson.encode({o = ARGV[2], loads = loads}))
end
return 0
"""

LOADS = _NOW + """
-- KEYS: lease sets. Returns the number of live leases in each (dropping expired ones);
-- -1 for a key that is not a sorted set (edited by hand), so the others are still read.
local out = {}
for i, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'zset' or kind == 'none' then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    out[i] = redis.call('ZCARD', key)
  else
    out[i] = -1
  end
end
return out
"""

_STORE_CHECK = """
-- Before anything is written (a script is not rolled back when a command fails half-way):
-- refuse a store edited by hand into what push and rm never write, naming the key.
local function corrupt(key, why)
  return redis.error_reply('ZMLCORRUPT ' .. key .. ' ' .. why)
end
local kinds = {'hash', 'hash', 'string'}
for k = 1, 3 do
  local kind = redis.call('TYPE', KEYS[k])['ok']
  if kind ~= 'none' and kind ~= kinds[k] then
    return corrupt(KEYS[k], 'holds a ' .. kind .. ', not a ' .. kinds[k])
  end
end
local function integer(value)
  return value == false or string.match(value, '^%-?%d+$') ~= nil
end
if not integer(redis.call('GET', KEYS[3])) then
  return corrupt(KEYS[3], 'holds a version that is not an integer')
end
for i = FIRST_NAME, #ARGV, NAME_STEP do
  if not integer(redis.call('HGET', KEYS[2], ARGV[i])) then
    return corrupt(KEYS[2], 'holds a version of ' .. ARGV[i] .. ' that is not an integer')
  end
end
"""

CORRUPT_MARK = "ZMLCORRUPT"
"""How an error reply of :data:`PUSH` and :data:`REMOVE` starts when a store key was edited
by hand (then the key and what is wrong with it follow; nothing was written)."""

PUSH = """
-- KEYS: policies hash, versions hash, store version. ARGV: channel, then name, JSON pairs.
-- Writes every policy, bumps each one's version and the store's, announces the change.
-- Returns {store version, {version of each policy, in order}}.
""" + _STORE_CHECK.replace("FIRST_NAME", "2").replace("NAME_STEP", "2") + """
local names = {}
local versions = {}
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  versions[#versions + 1] = redis.call('HINCRBY', KEYS[2], ARGV[i], 1)
  names[#names + 1] = ARGV[i]
end
local version = redis.call('INCR', KEYS[3])
redis.call('PUBLISH', ARGV[1], cjson.encode({op = 'push', names = names, version = version}))
return {version, versions}
"""

REMOVE = """
-- KEYS: policies hash, versions hash, store version. ARGV: channel, then names.
-- All or nothing: if a name is missing, nothing changes and {0, name} is returned.
-- Else each policy's version is bumped (a later push goes on counting), and
-- {store version, {version of each policy}} is returned.
""" + _STORE_CHECK.replace("FIRST_NAME", "2").replace("NAME_STEP", "1") + """
for i = 2, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then
    return {0, ARGV[i]}
  end
end
local names = {}
local versions = {}
for i = 2, #ARGV do
  redis.call('HDEL', KEYS[1], ARGV[i])
  versions[#versions + 1] = redis.call('HINCRBY', KEYS[2], ARGV[i], 1)
  names[#names + 1] = ARGV[i]
end
local version = redis.call('INCR', KEYS[3])
redis.call('PUBLISH', ARGV[1], cjson.encode({op = 'rm', names = names, version = version}))
return {version, versions}
"""
