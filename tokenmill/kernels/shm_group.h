// The tensor-parallel ranks of one host, summing and gathering through shared memory.
//
// A decode step of a sharded model sums partial results across ranks twice per layer. Through
// torch.distributed's gloo (loopback TCP) one such sum of a few KiB costs ~0.8 ms on a 2-core machine, longer
// than a whole layer; through a buffer every rank maps it costs a few microseconds. (gloo still sets the
// group up, and carries the sums between hosts: distributed/group.py.)
//
// The buffer (made by rank 0, mapped by every rank) holds:
//   a 64-byte line per rank: its sequence number (the collectives it has posted), its pid, the number of its
//   peers asleep on that number, and the messages it has taken;
//   a line for the group: the message sequence number, its sleepers, the message's length, a broken flag;
//   two slots per rank of `capacity` floats, alternating by sequence number;
//   the message area (rank 0's step descriptions to the others).
// Every rank runs the same collectives in the same order, so each keeps its own count of them; a rank posts
// collective s into its slot s % 2, and no rank overwrites a slot before every other has read it: it writes
// slot s % 2 again at s + 2, after every other rank has posted s + 1, which each does after reading s.
// Sums add the ranks' values in rank order, in float32, so every rank gets the same bits.
#pragma once

#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include <immintrin.h>

namespace tp {

struct alignas(64) RankLine {
  std::atomic<uint32_t> seq;       // collectives posted
  std::atomic<uint32_t> sleepers;  // peers asleep waiting on seq
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> taken;     // messages taken (the others' acknowledgement to rank 0)
  std::atomic<int64_t> calls, busy_ns, wait_ns;  // its collectives' count and time (ShmGroup::stats)
};

struct alignas(64) GroupLine {
  std::atomic<uint32_t> msg_seq;
  std::atomic<uint32_t> msg_sleepers;
  std::atomic<uint64_t> msg_len;
  std::atomic<uint32_t> broken;
  std::atomic<uint32_t> taken_sleepers;  // rank 0 asleep waiting for the others to take a message
};

static_assert(sizeof(RankLine) == 64 && sizeof(GroupLine) == 64, "one cache line each");
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "atomics in shared memory must be lock-free");

inline bool reached(uint32_t value, uint32_t target) { return (int32_t)(value - target) >= 0; }

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t value, long timeout_us) {
  timespec ts{timeout_us / 1000000, (timeout_us % 1000000) * 1000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, value, &ts, nullptr, 0);
}

inline void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

class ShmGroup {
 public:
  static int64_t bytes(int64_t world, int64_t capacity, int64_t msg_capacity) {
    return 64 * (world + 1) + world * 2 * capacity * (int64_t)sizeof(float) + msg_capacity;
  }

  // base: the shared buffer of bytes(world, capacity, msg_capacity) bytes, zeroed before any rank starts.
  ShmGroup(uint8_t* base, int64_t rank, int64_t world, int64_t capacity, int64_t msg_capacity)
      : rank_(rank), world_(world), capacity_(capacity), msg_capacity_(msg_capacity),
        ranks_(reinterpret_cast<RankLine*>(base)), group_(reinterpret_cast<GroupLine*>(base + 64 * world)),
        slots_(reinterpret_cast<float*>(base + 64 * (world + 1))),
        msg_(base + 64 * (world + 1) + world * 2 * capacity * sizeof(float)) {
    ranks_[rank].pid.store((int32_t)getpid());
    seq_ = ranks_[rank].seq.load();
  }

  // A rank started by another process (rank 0, or a launcher) that must leave when that process is gone:
  // once this process's parent is no longer `parent`, the group counts as broken.
  void watch_parent(int32_t parent) { parent_ = parent; }

  int64_t rank() const { return rank_; }
  int64_t world() const { return world_; }
  bool broken() const { return group_->broken.load() != 0; }
  void mark_broken() {
    group_->broken.store(1);
    for (int64_t r = 0; r < world_; ++r) futex_wake(&ranks_[r].seq), futex_wake(&ranks_[r].taken);
    futex_wake(&group_->msg_seq);
  }

  // x[n] := the sum of every rank's x[n], added in rank order in float32 and rounded to T once.
  template <typename T, typename ToFloat, typename FromFloat>
  void all_reduce(T* x, int64_t n, ToFloat to_float, FromFloat from_float) {
    const Clock clock(*this);
    for (int64_t done = 0; done < n; done += capacity_) {
      const int64_t m = std::min(capacity_, n - done);
      float* mine = post_begin();
      for (int64_t i = 0; i < m; ++i) mine[i] = to_float(x[done + i]);
      if (!post_end()) return;
      const uint32_t s = seq_ - 1;
      float* sum = x_sum_.size() >= (size_t)m ? x_sum_.data() : grow(m);
      std::memcpy(sum, slot(0, s), m * sizeof(float));
      for (int64_t r = 1; r < world_; ++r) {
        const float* theirs = slot(r, s);
        for (int64_t i = 0; i < m; ++i) sum[i] += theirs[i];
      }
      for (int64_t i = 0; i < m; ++i) x[done + i] = from_float(sum[i]);
    }
  }

  // out[r * n + i] := rank r's x[i], for every rank r (n floats at most `capacity` a call).
  void all_gather(const float* x, int64_t n, float* out) {
    const Clock clock(*this);
    for (int64_t done = 0; done < n; done += capacity_) {
      const int64_t m = std::min(capacity_, n - done);
      std::memcpy(post_begin(), x + done, m * sizeof(float));
      if (!post_end()) return;
      const uint32_t s = seq_ - 1;
      for (int64_t r = 0; r < world_; ++r) std::memcpy(out + r * n + done, slot(r, s), m * sizeof(float));
    }
  }

  // Rank 0: hands the others a message (len bytes), once every one has taken the one before. False where
  // the group is broken.
  bool send(const uint8_t* data, int64_t len) {
    if (len > msg_capacity_) return false;
    const uint32_t sent = group_->msg_seq.load();
    for (int64_t r = 1; r < world_; ++r)
      if (!wait_until(&ranks_[r].taken, &group_->taken_sleepers, sent, false)) return false;
    std::memcpy(msg_, data, len);
    group_->msg_len.store(len);
    group_->msg_seq.store(sent + 1, std::memory_order_release);
    futex_wake(&group_->msg_seq);  // unconditionally: a rank waiting for work sleeps most of the time
    return true;
  }

  // The other ranks: the next message from rank 0 (copied out and acknowledged), or an empty string with
  // *ok false where the group is broken (rank 0 gone, or closed).
  std::string recv(bool* ok) {
    const uint32_t want = ranks_[rank_].taken.load() + 1;
    if (!wait_until(&group_->msg_seq, &group_->msg_sleepers, want, true)) {
      *ok = false;
      return {};
    }
    std::string out(reinterpret_cast<const char*>(msg_), group_->msg_len.load());
    ranks_[rank_].taken.store(want, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // the store before the sleepers' load (see post_end)
    if (group_->taken_sleepers.load()) futex_wake(&ranks_[rank_].taken);
    *ok = true;
    return out;
  }

  int64_t max_message() const { return msg_capacity_; }

  // Rank r's (collectives run, seconds spent in them, seconds of that waiting for the other ranks) since
  // the start (each rank publishes its own in its line).
  std::tuple<int64_t, double, double> stats(int64_t r) const {
    const RankLine& l = ranks_[r];
    return {l.calls.load(), l.busy_ns.load() * 1e-9, l.wait_ns.load() * 1e-9};
  }

 private:
  struct Clock {  // adds a collective's time to the group's count
    ShmGroup& g;
    const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    explicit Clock(ShmGroup& group) : g(group) {}
    ~Clock() {
      RankLine& me = g.ranks_[g.rank_];
      me.calls.fetch_add(1, std::memory_order_relaxed);
      me.busy_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::steady_clock::now() - start).count(), std::memory_order_relaxed);
    }
  };

  float* slot(int64_t r, uint32_t s) const { return slots_ + (r * 2 + (s & 1)) * capacity_; }
  float* grow(int64_t m) {
    x_sum_.resize(m);
    return x_sum_.data();
  }

  float* post_begin() const { return slot(rank_, seq_); }

  // Posts this rank's slot and waits for every other rank's post of the same collective. False (and the
  // group marked broken) where a rank has died.
  bool post_end() {
    const uint32_t s = ++seq_;
    RankLine& me = ranks_[rank_];
    me.seq.store(s, std::memory_order_release);
    // A waiter adds itself to sleepers, then sleeps only while seq is unchanged (the futex compares): with
    // the store ordered before the load here, either it sees the new seq or this sees it and wakes it.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (me.sleepers.load()) futex_wake(&me.seq);
    const auto start = std::chrono::steady_clock::now();
    bool ok = true;
    for (int64_t r = 0; r < world_ && ok; ++r)
      if (r != rank_ && !wait_until(&ranks_[r].seq, &ranks_[r].sleepers, s, false)) ok = false;
    me.wait_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - start).count(), std::memory_order_relaxed);
    return ok;
  }

  // Waits until *word reaches target: spinning for a while (a peer in the same step arrives within
  // microseconds), then asleep on the futex in short naps, checking between naps that every rank lives.
  // idle: a wait that may last as long as the server is idle (a rank waiting for work) rather than a
  // collective's.
  bool wait_until(std::atomic<uint32_t>* word, std::atomic<uint32_t>* sleepers, uint32_t target, bool idle) {
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 1;; ++spins) {
      if (reached(word->load(std::memory_order_acquire), target)) return true;
      _mm_pause();
      if (spins % 256 == 0) {
        if (broken()) return false;
        if (std::chrono::steady_clock::now() - start > std::chrono::microseconds(idle ? 2000 : 300)) break;
      }
    }
    for (;;) {
      const uint32_t seen = word->load(std::memory_order_acquire);
      if (reached(seen, target)) return true;
      if (broken()) return false;
      sleepers->fetch_add(1);
      futex_wait(word, seen, idle ? 50000 : 1000);
      sleepers->fetch_sub(1);
      if (!reached(word->load(std::memory_order_acquire), target) && !all_alive()) {
        mark_broken();
        return false;
      }
    }
  }

  bool all_alive() const {
    if (parent_ > 0 && getppid() != parent_) return false;
    for (int64_t r = 0; r < world_; ++r) {
      const int32_t pid = ranks_[r].pid.load();
      if (r != rank_ && pid > 0 && !alive(pid)) return false;
    }
    return true;
  }

  // Whether a process runs: it exists and is not a zombie (one that died and was not yet reaped).
  static bool alive(int32_t pid) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    char path[64], buf[512];
    std::snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE* f = std::fopen(path, "r");
    if (!f) return true;  // no /proc: trust kill
    const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    buf[n] = 0;
    const char* close = std::strrchr(buf, ')');
    return !(close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X'));
  }

  int64_t rank_, world_, capacity_, msg_capacity_;
  RankLine* ranks_;
  GroupLine* group_;
  float* slots_;
  uint8_t* msg_;
  uint32_t seq_ = 0;
  int32_t parent_ = 0;
  std::vector<float> x_sum_;
};

}  // namespace tp
