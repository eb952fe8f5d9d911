// A cache of freed CPU tensor blocks for PyTorch, installed as its CPU allocator (rlhf_trl.cpu.install_tensor_cache).
//
// Why: a training step allocates the same activation shapes every step. PyTorch's default CPU allocator hands
// large blocks to glibc, which maps each (>= 32 MB, or >= M_MMAP_THRESHOLD) afresh and unmaps it when freed, so
// the kernel zeroes every activation page again at every step: 15-25 % of a Qwen2.5-0.5B value-model step on the
// CPUs of bench-real. Kept blocks are reused with their pages already in place.
//
// What: requests of at least `min_bytes` are rounded up to a size class (an eighth of their power of two: at most
// 12.5 % more address space, no more resident memory, as the pages past the request are never touched), so a
// tensor that grows a little at a time (the KV cache's torch.cat at every decoding step) reuses one block for many
// steps. Freed blocks are kept by size class; a request takes the most recently freed block of the
// smallest kept size that fits and leaves at most `max_unused` of it unused. A request no kept block serves first
// frees the oldest kept blocks until live + kept + request <= the most live bytes seen so far + `headroom` (or
// live + request when that is a new high): kept blocks never raise the peak of this allocator's footprint by more
// than `headroom` bytes. `release(reset_peak)` empties the cache and can restart "the most live bytes" from now.
// `set_aside(max_bytes)` keeps up to max_bytes of the most recently freed kept blocks out of use (resident, neither
// handed out nor freed by later releases) and frees the rest; `restore()` makes them kept blocks again: one phase's
// blocks (PPO's training) wait through other phases (the rollout) for the next time that phase needs them.
// Allocation itself is c10::alloc_cpu (its alignment; THP_MEM_ALLOC_ENABLE huge pages). Plain C entry points for
// ctypes; no Python headers needed.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

struct Cache {
  std::mutex mu;
  std::unordered_map<void*, size_t> live;               // block -> size, every block this allocator handed out
  std::map<size_t, std::deque<std::pair<void*, uint64_t>>> free;  // size -> kept blocks, oldest first
  std::map<uint64_t, std::pair<size_t, void*>> lru;     // free tick -> kept block, for eviction oldest first
  size_t cached = 0, min_bytes = 0, headroom = 0;  // bytes
  double max_unused = 0;                                // fraction of a kept block a request may leave unused
  size_t live_bytes = 0, peak_live = 0;                 // bytes of handed-out blocks (>= min_bytes): now, most ever
  std::vector<std::pair<void*, size_t>> aside;          // blocks set aside, most recently freed first
  size_t aside_bytes = 0;
  uint64_t tick = 0;
  uint64_t hits = 0, misses = 0;
  bool enabled = false;
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: tensors may be freed during interpreter shutdown
  return *c;
}

void take(Cache& c, void* p, size_t n) {
  c.live[p] = n;
  c.live_bytes += n;
  c.peak_live = std::max(c.peak_live, c.live_bytes);
}

void evict_oldest(Cache& c) {
  auto first = c.lru.begin();
  auto [n, p] = first->second;
  c.lru.erase(first);
  auto blocks = c.free.find(n);
  blocks->second.pop_front();  // ticks rise: the oldest block overall is the oldest of its size
  if (blocks->second.empty()) c.free.erase(blocks);
  c.cached -= n;
  c10::free_cpu(p);
}

void cached_delete(void* p) {
  if (p == nullptr) return;
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> g(c.mu);
    auto it = c.live.find(p);
    if (it != c.live.end()) {
      size_t n = it->second;
      c.live.erase(it);
      c.live_bytes -= n;
      if (c.enabled) {  // live + kept stays the same: within the budget
        uint64_t t = ++c.tick;
        c.free[n].emplace_back(p, t);
        c.lru.emplace(t, std::make_pair(n, p));
        c.cached += n;
        return;
      }
    }
  }
  c10::free_cpu(p);
}

// n rounded up to a multiple of an eighth of its power of two (>= 4 KB)
size_t size_class(size_t n) {
  size_t step = std::max<size_t>(size_t{1} << (63 - __builtin_clzll(n)) >> 3, 4096);
  return (n + step - 1) / step * step;
}

struct CachingCPUAllocator final : at::Allocator {
  at::DataPtr allocate(size_t n) override {
    Cache& c = cache();
    if (n >= c.min_bytes && n > 0) {
      n = size_class(n);
      std::lock_guard<std::mutex> g(c.mu);
      // the smallest kept size that fits, if the request leaves at most max_unused of it unused
      auto it = c.free.lower_bound(n);
      if (it != c.free.end() && static_cast<double>(it->first - n) <= c.max_unused * static_cast<double>(it->first)) {
        size_t m = it->first;
        auto [p, t] = it->second.back();  // the most recently freed block of this size: its pages are warmest
        it->second.pop_back();
        if (it->second.empty()) c.free.erase(it);
        c.lru.erase(t);
        c.cached -= m;
        take(c, p, m);
        ++c.hits;
        return {p, p, &cached_delete, at::Device(at::DeviceType::CPU)};
      }
      ++c.misses;
      // A fresh block: first free the oldest kept blocks until live + kept + n stays within the most live bytes
      // seen so far + headroom (or live + n when that is a new high).
      size_t budget = std::max(c.peak_live + c.headroom, c.live_bytes + n);
      while (c.cached > 0 && c.live_bytes + c.cached + n > budget) evict_oldest(c);
    }
    void* p = c10::alloc_cpu(n);
    if (n >= c.min_bytes && n > 0) {
      std::lock_guard<std::mutex> g(c.mu);
      take(c, p, n);
      return {p, p, &cached_delete, at::Device(at::DeviceType::CPU)};
    }
    return {p, p, &c10::free_cpu, at::Device(at::DeviceType::CPU)};
  }
  // raw_allocate / raw_deallocate (oneDNN's buffers): blocks it does not know go to c10::free_cpu
  at::DeleterFnPtr raw_deleter() const override { return &cached_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CachingCPUAllocator* the_allocator() {
  static CachingCPUAllocator* a = new CachingCPUAllocator();
  return a;
}

size_t release_locked(Cache& c) {
  size_t n = c.cached;
  for (auto& kv : c.lru) c10::free_cpu(kv.second.second);
  c.lru.clear();
  c.free.clear();
  c.cached = 0;
  return n;
}

// the set-aside blocks become kept blocks again, in their freeing order (the most recently freed one last)
size_t restore_locked(Cache& c) {
  size_t n = c.aside_bytes;
  for (auto it = c.aside.rbegin(); it != c.aside.rend(); ++it) {
    uint64_t t = ++c.tick;
    c.free[it->second].emplace_back(it->first, t);
    c.lru.emplace(t, std::make_pair(it->second, it->first));
    c.cached += it->second;
  }
  c.aside.clear();
  c.aside_bytes = 0;
  return n;
}

}  // namespace

extern "C" {

// Installs the cache as PyTorch's CPU allocator (priority 200; later allocations only). Returns 0.
int rlhf_trl_tensor_cache_install(uint64_t headroom_bytes, uint64_t min_bytes, double max_unused) {
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> g(c.mu);
    c.min_bytes = min_bytes;
    c.headroom = headroom_bytes;
    c.max_unused = max_unused;
    c.enabled = true;
  }
  c10::SetCPUAllocator(the_allocator(), /*priority=*/200);
  return 0;
}

// Frees every kept block; with reset_peak, the most live bytes seen so far become the live bytes now (the budget
// starts again from here). Returns the bytes freed.
uint64_t rlhf_trl_tensor_cache_release(int reset_peak) {
  Cache& c = cache();
  std::lock_guard<std::mutex> g(c.mu);
  if (reset_peak) c.peak_live = c.live_bytes;
  return release_locked(c);
}

// Keeps up to max_bytes of the kept blocks (and of any set aside before), the most recently freed first, out of use
// until rlhf_trl_tensor_cache_restore; frees the others; with reset_peak the most live bytes seen so far become the
// live bytes now. Returns the bytes set aside.
uint64_t rlhf_trl_tensor_cache_set_aside(uint64_t max_bytes, int reset_peak) {
  Cache& c = cache();
  std::lock_guard<std::mutex> g(c.mu);
  restore_locked(c);
  for (auto it = c.lru.rbegin(); it != c.lru.rend(); ++it) {
    auto [n, p] = it->second;
    if (c.aside_bytes + n <= max_bytes) {
      c.aside.emplace_back(p, n);
      c.aside_bytes += n;
    } else {
      c10::free_cpu(p);
    }
  }
  c.lru.clear();
  c.free.clear();
  c.cached = 0;
  if (reset_peak) c.peak_live = c.live_bytes;
  return c.aside_bytes;
}

// The blocks set aside become kept blocks again; the most live bytes seen so far become at least live + kept bytes
// (blocks that were resident all along do not count as raising the footprint). Returns the bytes restored.
uint64_t rlhf_trl_tensor_cache_restore() {
  Cache& c = cache();
  std::lock_guard<std::mutex> g(c.mu);
  size_t n = restore_locked(c);
  c.peak_live = std::max(c.peak_live, c.live_bytes + c.cached);
  return n;
}

// Stops keeping blocks (frees the kept ones) and gives PyTorch its default CPU allocator back.
uint64_t rlhf_trl_tensor_cache_uninstall() {
  Cache& c = cache();
  uint64_t n;
  {
    std::lock_guard<std::mutex> g(c.mu);
    c.enabled = false;
    restore_locked(c);
    n = release_locked(c);
  }
  c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), /*priority=*/200);
  return n;
}

// out[0..6] = bytes kept now, hits, misses, live blocks, live bytes, most live bytes, bytes set aside.
void rlhf_trl_tensor_cache_stats(uint64_t* out) {
  Cache& c = cache();
  std::lock_guard<std::mutex> g(c.mu);
  out[0] = c.cached;
  out[1] = c.hits;
  out[2] = c.misses;
  out[3] = c.live.size();
  out[4] = c.live_bytes;
  out[5] = c.peak_live;
  out[6] = c.aside_bytes;
}

}
