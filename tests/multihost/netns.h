// NetnsCluster: several "hosts" on this one machine, each a Linux network
// namespace with its own loopback and one address, all joined by a Linux
// bridge, so that multi-host tests run real processes over real sockets with
// real host crashes and partitions.
//
// Layout of one cluster (tag = "nst" + creating pid + one letter, e.g. "nst4711a"):
//
//   namespace nst4711ah0 (lo, eth0 10.a.b.1/24) --veth-- nst4711av0 --+
//   namespace nst4711ah1 (lo, eth0 10.a.b.2/24) --veth-- nst4711av1 --+-- bridge nst4711abr
//   ...                                                               |   (no address: the root
//   namespace nst4711ahN (lo, eth0 10.a.b.N+1/24) -veth- nst4711avN --+    namespace is not a host)
//
// With NetnsFamily::kIPv6 the hosts get fd6e:7374:a:b::(i+1)/64 instead (the same a.b, so IPv6
// clusters never overlap either), added with `nodad` so that they are usable at once, and no IPv4
// address at all: everything a test dials there is IPv6.
//
// Only the harness's own addresses exist in the namespaces: no default route, no NAT, nothing
// reaches the outside. 10.a.b.0/24 is chosen so that clusters alive at the same time (in one
// process or in several, ctest -j) never share a subnet, nor with any address of the root
// namespace; the subnet is written in the bridge's alias (/sys/class/net/BR/ifalias) so that other
// creators see it. Names carry the creating pid (and the alias its start time), so the leftovers of
// a run that crashed (its pid no longer running, or running a process that started later) are
// removed by the next Create.
//
// Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and `ip` from iproute2; Create says what is missing.
// All `ip` commands are run by fork/exec with an argv (no shell).
//
// Ownership: the cluster owns its namespaces, veths and bridge, and every process running in its
// namespaces; the destructor kills those processes (SIGKILL), reaps the ones Spawn started, and
// deletes everything. Spawned processes also get PR_SET_PDEATHSIG(SIGKILL), so a test that crashes
// leaves no process behind (the namespaces are removed by the next Create). PDEATHSIG fires when
// the *thread* that called Spawn exits: call Spawn from a thread that outlives the children (a test
// body's thread does).
//
// Thread-safety: none; one test thread drives a cluster.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "nonstop/status.h"

namespace nonstop::testing {

// The address family of a cluster's hosts: one family only, so that a test on kIPv6 cannot pass by
// falling back to IPv4.
enum class NetnsFamily { kIPv4, kIPv6 };

class NetnsCluster {
 public:
  static constexpr int kMaxHosts = 253;  // 10.a.b.1 .. 10.a.b.253

  // Creates `hosts` namespaces (1..kMaxHosts) joined by one bridge; host i gets 10.a.b.(i+1)/24 on
  // its eth0 and loopback up. First removes the leftovers of dead creators. kFailedPrecondition
  // when this process lacks the privileges, `ip` is missing (install iproute2) or the kernel
  // refuses namespaces (an unprivileged container); the message says how to fix it.
  // With kIPv6, host i gets fd6e:7374:a:b::(i+1)/64 and no IPv4 address.
  static Result<std::unique_ptr<NetnsCluster>> Create(int hosts,
                                                      NetnsFamily family = NetnsFamily::kIPv4);

  // Destroy().
  ~NetnsCluster();
  NetnsCluster(const NetnsCluster&) = delete;
  NetnsCluster& operator=(const NetnsCluster&) = delete;

  // Kills every process in the cluster's namespaces (SIGKILL), reaps the children Spawn started
  // (waiting at most a few seconds), deletes the veths, the bridge and the namespaces. Idempotent;
  // the first failure is returned, but every step is tried. After it only the accessors may be
  // called.
  Status Destroy();

  int hosts() const { return static_cast<int>(hosts_.size()); }
  const std::string& address(int host) const;  // "10.a.b.c", or "fd6e:7374:a:b::c" on kIPv6
  // address:port as every nonstop flag takes it: "10.a.b.c:PORT", "[fd6e:7374:a:b::c]:PORT".
  std::string HostPort(int host, int port) const;
  NetnsFamily family() const { return family_; }
  const std::string& name(int host) const;  // the namespace name (/var/run/netns/NAME)
  const std::string& bridge() const { return bridge_; }
  // "10.a.b.0/24", or "fd6e:7374:a:b::/64" on kIPv6
  const std::string& subnet() const { return subnet_; }
  // The bridge-side end of host's veth pair (in the root namespace), which LinkDown sets down.
  const std::string& bridge_port(int host) const;

  // Starts argv in host's namespace: fork; in the child PR_SET_PDEATHSIG(SIGKILL), setns into the
  // namespace, stdin from /dev/null, stdout and stderr appended to log_path (created if need be),
  // then execvp with this process's environment plus `env` (later entries override). Fails (and
  // leaves no process) when argv[0] cannot be executed. Returns the pid; reap it with WaitForExit,
  // or leave it to the destructor.
  Result<pid_t> Spawn(int host, const std::vector<std::string>& argv,
                      const std::vector<std::pair<std::string, std::string>>& env,
                      const std::string& log_path);

  // Reaps a child started by Spawn: its wait status (WIFEXITED/WEXITSTATUS, WIFSIGNALED/WTERMSIG),
  // or nullopt when `timeout` passed first (the child keeps running) or pid is not an unreaped
  // child.
  std::optional<int> WaitForExit(pid_t pid, std::chrono::milliseconds timeout);

  // Host crash: SIGKILLs every process whose network namespace is host's (its /proc/PID/ns/net is
  // the namespace's inode), repeating until a scan finds none, so that processes forked meanwhile
  // die too. Returns how many were killed. Children of this process stay zombies until reaped
  // (WaitForExit).
  int KillHost(int host);
  // Sends `signal` once to every process of host's namespace (as a scheduler signals every process
  // of a job step). Returns how many were signalled.
  int SignalHost(int host, int signal);

  // Partition and heal: sets host's bridge-side veth down / up, so that the host's traffic to and
  // from every other host stops / resumes. Its addresses, sockets and processes stay; TCP
  // connections survive a partition shorter than their retransmission timeout. During a partition,
  // connecting to or from the host fails with a timeout, or EHOSTUNREACH once address resolution
  // (ARP) gives up. LinkUp also flushes every host's neighbour cache, so that a resolution that
  // failed during the partition does not fail the first connection after the heal.
  Status LinkDown(int host);
  Status LinkUp(int host);

  // Runs argv in host's namespace (setns, no shell) and waits for it: (exit code, stdout and stderr
  // merged). A command killed by a signal reports 128 + the signal. kDeadlineExceeded (and the
  // command is killed) when it runs past `timeout`, or when a background process it left holds its
  // output open. Unlike `ip netns exec`, only the network namespace changes: /sys/class/net still
  // lists the root namespace's interfaces (ask `ip`, which uses netlink).
  Result<std::pair<int, std::string>> Exec(
      int host, const std::vector<std::string>& argv,
      std::chrono::milliseconds timeout = std::chrono::seconds(10));

  // Runs fn on a new thread that has joined host's network namespace (setns changes the calling
  // thread's namespace only), and waits for it: every socket fn opens is the host's, so that the
  // test process itself can dial (or listen) inside a host, e.g. ask an etcd member for its
  // status. kInternal (fn not run) when the namespace cannot be joined.
  Status RunIn(int host, const std::function<void()>& fn);

 private:
  struct Host {
    std::string netns;        // namespace name, e.g. "nst4711ah0"
    std::string bridge_port;  // root-namespace end of the veth pair, e.g. "nst4711av0"
    std::string address;      // "10.a.b.(i+1)"
  };

  NetnsCluster() = default;
  Status Build();  // the bridge, then each host's namespace, veth pair and addresses
  const Host& HostAt(int host) const;

  std::string tag_;     // "nst<pid><letter>"
  std::string bridge_;  // tag_ + "br"
  std::string subnet_;  // "10.a.b.0/24" or "fd6e:7374:a:b::/64"
  NetnsFamily family_ = NetnsFamily::kIPv4;
  // 10.a.b.0/24 whatever the family: what the bridge's alias records, so that no other cluster
  // takes a.b
  std::string ipv4_subnet_;
  std::vector<Host> hosts_;
  std::set<pid_t> children_;  // started by Spawn, not yet reaped
  bool destroyed_ = false;
};

}  // namespace nonstop::testing
