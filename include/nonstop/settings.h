// The job's settings: every NONSTOP_* environment variable, written once
// (docs/architecture.md "Code style": NCCL_PARAM's idea without the sprawl). Each entry says its
// variable, its command-line flag if it has one, its type and default, the
// values it takes, the programs that read it and those that set it for
// others, and its help text. docs/settings.md is printed from here (`nonstop
// settings`); a test fails on a NONSTOP_* string literal that is not an entry.
//
// The programs take their defaults from the entries (JobFlags, RuntimeOptions,
// ControllerOptions, AgentOptions); their flags are registered from them
// (nonstop/settings_cli.h: name, help, environment fallback, default
// shown, range); the code that sets or reads a variable names its entry's
// `env`, never a literal. Precedence, as CLI11 has it: flag, then variable,
// then default.
//
// One variable, one entry, unless the programs that read it give it different
// meanings or defaults: then there is one entry per (program, meaning), each
// with a `note` that names the others, and no program reads one name two
// ways (settings_test checks both). NONSTOP_JOIN_TIMEOUT_MS, for instance, is
// the job's forming bound to `nonstop run` (300000) and the reach-the-
// controller bound to `nonstop agent` (60000). docs/settings.md lists them all.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace nonstop::settings {

// The programs that read a variable (or set it for another); a bit set.
enum Program : uint32_t {
  kRun = 1u << 0,         // nonstop run
  kController = 1u << 1,  // nonstop controller
  kAgent = 1u << 2,       // nonstop agent
  // every worker's Session (SessionOptions::FromEnvironment; C++ and Python alike)
  kWorker = 1u << 3,
  kTrain = 1u << 4,        // nonstop-train's own flags
  kJobCommands = 1u << 5,  // nonstop status, nonstop scale, nonstop worker
  kData = 1u << 6,         // nonstop data prepare
  kPython = 1u << 7,       // the Python package itself (python/nonstop), besides its Session
};
inline constexpr int kProgramCount = 8;

// Lists: their defaults are empty; a variable holds one value ("2,4,8").
using IntList = std::span<const int>;
using StringList = std::span<const std::string_view>;

template <typename T>
struct Bounds {
  T lo;
  T hi;
};

// One variable as one program (or several, alike) reads it. T: bool, int,
// int64_t, uint64_t, double, std::string_view (a string), IntList or
// StringList.
template <typename T>
struct Setting {
  // The variable. Entries are made of string literals: env.data() is
  // NUL-terminated, for getenv and setenv.
  std::string_view env;
  // CLI11's names of the flag ("--nproc", "--resumable,!--single-process");
  // empty: a variable only (a launcher sets it for its workers).
  std::string_view flag;
  T default_value{};
  std::optional<Bounds<T>> range{};             // numbers: the values allowed, both ends included
  std::span<const std::string_view> choices{};  // strings: the only values allowed
  // lists: ',' splits one value ("2,4,8"); 0: one item per flag, the flag repeated
  char delimiter = 0;
  bool required = false;
  bool show_default = true;  // --help shows the default (flags, i.e. bools, never do)
  uint32_t read_by = 0;
  uint32_t set_by = 0;  // the programs that set it in a worker's environment
  std::string_view help;
  std::string_view default_doc{};  // what the default means, where its value does not say
  std::string_view note{};         // the other entries of the same variable
};

// The entries leave fields at their defaults, which GCC before 14 reports
// under -Wextra (as in planner_test).
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#endif

inline constexpr std::string_view kRecoveryChoices[] = {"checkpointless", "checkpoint"};
inline constexpr std::string_view kOnSigtermChoices[] = {"leave", "stop"};

// ---- the job: `nonstop run` and `nonstop controller` ----

inline constexpr Setting<std::string_view> kJournal{.env = "NONSTOP_JOURNAL",
                                                    .flag = "--journal",
                                                    .default_value = "runs/journal.jsonl",
                                                    .read_by = kRun | kController,
                                                    .help = "Event journal (JSON lines)"};
inline constexpr Setting<int> kHeartbeatTimeoutMs{
    .env = "NONSTOP_HEARTBEAT_TIMEOUT_MS",
    .flag = "--heartbeat-timeout-ms",
    .default_value = 1'000,
    .range = Bounds<int>{100, 3'600'000},
    .read_by = kRun | kController,
    .help = "A worker (or agent) silent this long is declared failed"};
inline constexpr Setting<int> kAbortTimeoutMs{
    .env = "NONSTOP_ABORT_TIMEOUT_MS",
    .flag = "--abort-timeout-ms",
    .default_value = 2'000,
    .range = Bounds<int>{100, 3'600'000},
    .read_by = kRun | kController,
    .help = "Members that have not aborted this long after a fault are killed and replaced"};
inline constexpr Setting<int> kBusyTimeoutMs{
    .env = "NONSTOP_BUSY_TIMEOUT_MS",
    .flag = "--busy-timeout-ms",
    .default_value = 60'000,
    .range = Bounds<int>{100, 86'400'000},
    .read_by = kRun | kController,
    .help =
        "A live member (heartbeats flowing, not stopped) that has not reached a step's collective "
        "this long after the first member did (or, when no one waits, has completed no step) is "
        "declared hung. Lower finds a deadlocked or spinning training thread sooner but kills a "
        "rank that legitimately saves or evaluates longer; a dead or stopped process is found at "
        "once whatever it is (docs/recovery.md)"};
inline constexpr Setting<double> kHangFactor{
    .env = "NONSTOP_HANG_FACTOR",
    .flag = "--hang-factor",
    .default_value = 8.0,
    .range = Bounds<double>{1.0, 1000.0},
    .read_by = kRun | kController,
    .help =
        "The busy timeout learns the job's pace above its floor: at least this many times the "
        "recent spread between the first and the last member's arrival at a step's collective, "
        "and this many times the median step"};
inline constexpr Setting<int> kStallFloorMs{
    .env = "NONSTOP_STALL_FLOOR_MS",
    .flag = "--stall-floor-ms",
    .default_value = 30'000,
    .range = Bounds<int>{1'000, 86'400'000},
    .read_by = kRun | kController,
    .help =
        "Stall watchdog: when every member waits in a collective and no step completes for this "
        "long (at least; and --stall-factor × the median step), every member is aborted, and those "
        "that cannot answer are replaced (while a member computes, --busy-timeout-ms is the "
        "bound)"};
inline constexpr Setting<double> kStallFactor{
    .env = "NONSTOP_STALL_FACTOR",
    .flag = "--stall-factor",
    .default_value = 10.0,
    .range = Bounds<double>{1.0, 1000.0},
    .read_by = kRun | kController,
    .help = "Stall watchdog: … and this many times the median step"};
inline constexpr Setting<int> kFailureRepeats{
    .env = "NONSTOP_FAILURE_REPEATS",
    .flag = "--failure-repeats",
    .default_value = 2,
    .range = Bounds<int>{1, 1'000},
    .read_by = kRun | kController,
    .help =
        "A failure the script raised that recurs this many times (the same exception and message "
        "on the same rank or at the same step) is the script's: the job ends with exit 12 instead "
        "of replacing the rank again (1: the first recurrence ends it)"};
inline constexpr Setting<int> kFailureWindowMs{
    .env = "NONSTOP_FAILURE_WINDOW_MS",
    .flag = "--failure-window-ms",
    .default_value = 300,
    .range = Bounds<int>{0, 60'000},
    .read_by = kRun | kController,
    .help =
        "A failure the script raised is acted on this long after its report, so that the other "
        "members' reports of the same step are seen with it: when every member raised the same "
        "exception, the job ends at once (exit 12). Longer catches ranks that are further apart; "
        "it delays the recovery from a failure that is not the script's by as much"};
inline constexpr Setting<int> kRecoveryBudget{
    .env = "NONSTOP_RECOVERY_BUDGET",
    .flag = "--recovery-budget",
    .default_value = 20,
    .range = Bounds<int>{1, 1'000'000},
    .read_by = kRun | kController,
    .help =
        "The job ends (exit 10) when it needs more recoveries than this within "
        "--recovery-budget-window-s: the last guard against a loop of faults that nothing else "
        "stops"};
inline constexpr Setting<int> kRecoveryBudgetWindowS{
    .env = "NONSTOP_RECOVERY_BUDGET_WINDOW_S",
    .flag = "--recovery-budget-window-s",
    .default_value = 600,
    .range = Bounds<int>{1, 86'400 * 30},
    .read_by = kRun | kController,
    .help = "The sliding window of --recovery-budget, in seconds"};
inline constexpr Setting<int> kRefillNice{
    .env = "NONSTOP_REFILL_NICE",
    .flag = "--refill-nice",
    .default_value = 10,
    .range = Bounds<int>{0, 19},
    .read_by = kRun | kController,
    .help =
        "Niceness at which local spares that refill the pool warm up while the job trains (0: "
        "normal "
        "priority; used only where the priority can be raised back when the spare takes a rank)"};
inline constexpr Setting<int> kJoinTimeoutMs{
    .env = "NONSTOP_JOIN_TIMEOUT_MS",
    .flag = "--join-timeout-ms",
    .default_value = 300'000,
    .range = Bounds<int>{1'000, 86'400'000},
    .read_by = kRun | kController,
    .help =
        "The job must form within this long of its start, and a spare started later must join "
        "within it "
        "(else it is killed and replaced)",
    .note =
        "`nonstop agent` reads the same variable as its own --join-timeout-ms, another bound with "
        "another "
        "default (60000: reaching the controller); one environment for both sets both"};
inline constexpr Setting<StringList> kInject{
    .env = "NONSTOP_INJECT",
    .flag = "--inject",
    .show_default = false,
    .read_by = kRun | kController,
    .help =
        "Faults to inject, e.g. kill:rank=2,step=30 or hang:rank=1,time=5 (kinds: kill, hang, "
        "exception, "
        "drop, corrupt; see docs/faults.md); 'none' for no fault",
    .default_doc = "none (`nonstop run` without a program: kill:rank=2,step=30)"};
inline constexpr Setting<std::string_view> kRecovery{
    .env = "NONSTOP_RECOVERY",
    .flag = "--recovery",
    .default_value = "checkpointless",
    .choices = kRecoveryChoices,
    .read_by = kRun | kController,
    .help =
        "checkpointless (in-process recovery, spares, peer state transfer) or checkpoint (the "
        "checkpoint-restart baseline: on a fault restart every worker from the newest checkpoint)"};
inline constexpr Setting<std::string_view> kCheckpointDir{
    .env = "NONSTOP_CHECKPOINT_DIR",
    .flag = "--checkpoint-dir",
    .show_default = false,
    .read_by = kRun | kController,
    .help =
        "Durable checkpoints go here (passed to workers as NONSTOP_CHECKPOINT_DIR); also the last "
        "rung of "
        "checkpointless recovery",
    .default_doc = "none: no checkpoints",
    .note =
        "the job passes it on to its workers (nonstop-train's --checkpoint-dir), and the job file "
        "keeps it "
        "for `nonstop worker`"};
inline constexpr Setting<int> kCheckpointEvery{
    .env = "NONSTOP_CHECKPOINT_EVERY",
    .flag = "--checkpoint-every",
    .default_value = 0,
    .range = Bounds<int>{0, 1'000'000},
    .read_by = kRun | kController,
    .help =
        "Steps between checkpoints (0: the Young/Daly optimum for --mtbf, measured by the trainer)",
    .note =
        "passed on to the workers with --checkpoint-dir; nonstop-train reads it with its own "
        "default (-1: the "
        "recipe's checkpoint.every)"};
inline constexpr Setting<double> kMtbfSeconds{
    .env = "NONSTOP_MTBF_SECONDS",
    .flag = "--mtbf",
    .default_value = 0,
    .range = Bounds<double>{0.0, 1e9},
    .read_by = kRun | kController,
    .help = "Mean time between failures assumed for the checkpoint interval (seconds)",
    .note = "passed on to the workers with --checkpoint-dir (nonstop-train's --mtbf)"};
inline constexpr Setting<std::string_view> kHttpHost{
    .env = "NONSTOP_HTTP_HOST",
    .flag = "--http-host",
    .default_value = "127.0.0.1",
    .read_by = kRun | kController,
    .help = "Address of the HTTP endpoint (/status /metrics /events /scale)"};
inline constexpr Setting<int> kHttpPort{.env = "NONSTOP_HTTP_PORT",
                                        .flag = "--http-port",
                                        .default_value = 0,
                                        .range = Bounds<int>{0, 65535},
                                        .read_by = kRun | kController,
                                        .help = "Port of the HTTP endpoint (0: chosen by the OS)"};
inline constexpr Setting<std::string_view> kHttpCert{
    .env = "NONSTOP_HTTP_CERT",
    .flag = "--http-cert",
    .show_default = false,
    .read_by = kRun | kController,
    .help =
        "Serve the HTTP endpoint as HTTPS with this certificate (PEM, leaf first; with "
        "--http-key)",
    .default_doc = "none: plain HTTP"};
inline constexpr Setting<std::string_view> kHttpKey{
    .env = "NONSTOP_HTTP_KEY",
    .flag = "--http-key",
    .show_default = false,
    .read_by = kRun | kController,
    .help = "The private key of --http-cert (PEM, no passphrase, readable by the owner only)",
    .default_doc = "none"};
inline constexpr Setting<int> kMinWorld{.env = "NONSTOP_MIN_WORLD",
                                        .flag = "--min-world",
                                        .default_value = 1,
                                        .range = Bounds<int>{1, 1 << 20},
                                        .read_by = kRun | kController,
                                        .help = "Elastic policy: the smallest world size"};
inline constexpr Setting<int> kMaxWorld{
    .env = "NONSTOP_MAX_WORLD",
    .flag = "--max-world",
    .default_value = 0,
    .range = Bounds<int>{0, 1 << 20},
    .read_by = kRun | kController,
    .help = "Elastic policy: the largest world size (0: the initial one)"};
inline constexpr Setting<IntList> kAllowedSizes{
    .env = "NONSTOP_ALLOWED_SIZES",
    .flag = "--allowed-sizes",
    .delimiter = ',',
    .show_default = false,
    .read_by = kRun | kController,
    .help = "Elastic policy: the only world sizes allowed, e.g. 2,4,8",
    .default_doc = "any size the other rules allow"};
inline constexpr Setting<int> kWorldIncrement{
    .env = "NONSTOP_WORLD_INCREMENT",
    .flag = "--world-increment",
    .default_value = 1,
    .range = Bounds<int>{1, 1 << 20},
    .read_by = kRun | kController,
    .help = "Elastic policy: sizes are min-world + k × this"};
inline constexpr Setting<int> kStablePeriodMs{
    .env = "NONSTOP_STABLE_PERIOD_MS",
    .flag = "--stable-period-ms",
    .default_value = 0,
    .range = Bounds<int>{0, 86'400'000},
    .read_by = kRun | kController,
    .help =
        "Elastic policy: the least time between two changes (doubles when changes come too often)"};
inline constexpr Setting<std::string_view> kLogLevel{.env = "NONSTOP_LOG_LEVEL",
                                                     .flag = "--log-level",
                                                     .default_value = "info",
                                                     .read_by = kRun | kController | kAgent,
                                                     .help = "debug, info, warning or error"};

// ---- `nonstop run` alone ----

inline constexpr Setting<int> kNproc{.env = "NONSTOP_NPROC",
                                     .flag = "--nproc",
                                     .default_value = 4,
                                     .range = Bounds<int>{1, 1024},
                                     .read_by = kRun,
                                     .help = "Worker processes that train (the world size)"};
inline constexpr Setting<int> kSpares{.env = "NONSTOP_SPARES",
                                      .flag = "--spares",
                                      .default_value = 1,
                                      .range = Bounds<int>{0, 1024},
                                      .read_by = kRun,
                                      .help = "Pre-warmed spare workers that wait without a rank"};
inline constexpr Setting<std::string_view> kHost{
    .env = "NONSTOP_HOST",
    .flag = "--host",
    .default_value = "127.0.0.1",
    .read_by = kRun,
    .help = "Address the controller and the workers listen on"};
inline constexpr Setting<int> kPort{.env = "NONSTOP_PORT",
                                    .flag = "--port",
                                    .default_value = 0,
                                    .range = Bounds<int>{0, 65535},
                                    .read_by = kRun,
                                    .help = "Controller port (0: chosen by the OS)"};
inline constexpr Setting<bool> kResumable{
    .env = "NONSTOP_RESUMABLE",
    .flag = "--resumable,!--single-process",
    .default_value = true,
    .read_by = kRun,
    .help =
        "The default: the controller runs in a process of its own, this process supervises the "
        "workers (a "
        "local agent); if the controller dies, the workers train on and this process starts it "
        "again at once "
        "(`nonstop controller --resume JOURNAL --nnodes 1 --job-token-file <run dir>/job.token`), "
        "which adopts "
        "them. --single-process: the controller and the workers' supervisor in this one process "
        "(its death "
        "ends the workers)"};
inline constexpr Setting<bool> kVerbose{.env = "NONSTOP_VERBOSE",
                                        .flag = "--verbose,-v",
                                        .default_value = false,
                                        .read_by = kRun,
                                        .help =
                                            "Every worker's output on the terminal, prefixed by "
                                            "its rank (the default when stdout is not a "
                                            "terminal); without it, a terminal shows one live "
                                            "progress line and the workers' output goes to "
                                            "<run dir>/logs/worker-N.log"};

// ---- `nonstop controller` alone ----

inline constexpr Setting<std::string_view> kListen{
    .env = "NONSTOP_LISTEN",
    .flag = "--listen",
    .default_value = "127.0.0.1:0",
    .read_by = kController,
    .help = "ADDR:PORT of the control port (workers and agents; port 0: from the OS)"};
inline constexpr Setting<std::string_view> kControllerAdvertiseAddress{
    .env = "NONSTOP_ADVERTISE_ADDRESS",
    .flag = "--advertise-address",
    .show_default = false,
    .read_by = kController,
    .help = "The address agents and workers dial (needed when --listen is 0.0.0.0)",
    .default_doc = "the --listen address",
    .note =
        "the controller's control address; to `nonstop agent` and to a worker the same variable is "
        "a data "
        "address (the entries below)"};
inline constexpr Setting<std::string_view> kNnodes{
    .env = "NONSTOP_NNODES",
    .flag = "--nnodes",
    .default_value = "1",
    .read_by = kController,
    .help =
        "MIN or MIN:MAX hosts: the job starts when MIN agents have registered; more join as "
        "capacity (up to "
        "MAX)"};
inline constexpr Setting<std::string_view> kControllerJobTokenFile{
    .env = "NONSTOP_JOB_TOKEN_FILE",
    .flag = "--job-token-file",
    .required = true,
    .show_default = false,
    .read_by = kController,
    .help =
        "Write the job token here (mode 0600) for the agents' --job-token-file; a file that exists "
        "and holds "
        "a token is used as it is",
    .note =
        "the same file as the agents' --job-token-file: the controller writes it, the agents read "
        "it"};
inline constexpr Setting<std::string_view> kControllerEtcd{
    .env = "NONSTOP_ETCD",
    .flag = "--etcd",
    .show_default = false,
    .read_by = kController,
    .help =
        "Lead through etcd (host:port[,host:port…]): run this on several machines; one leads, the "
        "others "
        "stand by and take over (journal and state in etcd) when its lease ends",
    .default_doc = "none: no etcd",
    .note =
        "the controller campaigns there; an agent and its workers look the leader up there (the "
        "next entry)"};
inline constexpr Setting<std::string_view> kEtcdJob{.env = "NONSTOP_ETCD_JOB",
                                                    .flag = "--job",
                                                    .default_value = "default",
                                                    .read_by = kController | kAgent | kWorker,
                                                    .set_by = kAgent,
                                                    .help = "The job's name in etcd (with --etcd)"};
inline constexpr Setting<int> kLeaseTtlS{
    .env = "NONSTOP_LEASE_TTL_S",
    .flag = "--lease-ttl-s",
    .default_value = 10,
    .range = Bounds<int>{1, 300},
    .read_by = kController,
    .help =
        "The leader's etcd lease in seconds (with --etcd): a leader that dies is replaced within "
        "about this "
        "plus 1 s. It is renewed every fifth of it, so an etcd outage or overload shorter than 0.6 "
        "of it deposes "
        "nobody; a longer one costs a takeover, not a step (docs/controller-failover.md, "
        "\"Timing\")"};

// ---- etcd's TLS and user (`nonstop controller --etcd`, `nonstop agent --etcd`, a worker
// asking etcd; docs/etcd-security.md). The agent passes them to its workers: paths only. ----

inline constexpr Setting<std::string_view> kEtcdCacert{
    .env = "NONSTOP_ETCD_CACERT",
    .flag = "--etcd-cacert",
    .show_default = false,
    .read_by = kController | kAgent | kWorker,
    .set_by = kAgent,
    .help =
        "The CA certificate (PEM) that signed etcd's server certificate: talk to etcd over TLS "
        "and check its certificate against it (https:// endpoints)",
    .default_doc = "the system's CAs (with https:// endpoints); no TLS otherwise"};
inline constexpr Setting<std::string_view> kEtcdCert{
    .env = "NONSTOP_ETCD_CERT",
    .flag = "--etcd-cert",
    .show_default = false,
    .read_by = kController | kAgent | kWorker,
    .set_by = kAgent,
    .help =
        "This client's certificate (PEM) for etcd's client-certificate authentication "
        "(with --etcd-key)",
    .default_doc = "none"};
inline constexpr Setting<std::string_view> kEtcdKey{
    .env = "NONSTOP_ETCD_KEY",
    .flag = "--etcd-key",
    .show_default = false,
    .read_by = kController | kAgent | kWorker,
    .set_by = kAgent,
    .help = "The private key (PEM, unencrypted, mode 600) of --etcd-cert",
    .default_doc = "none"};
inline constexpr Setting<std::string_view> kEtcdAuthFile{
    .env = "NONSTOP_ETCD_AUTH_FILE",
    .flag = "--etcd-auth-file",
    .show_default = false,
    .read_by = kController | kAgent | kWorker,
    .set_by = kAgent,
    .help =
        "A file (mode 600) of one line user:password: the etcd user to authenticate as, when "
        "etcd has auth enabled",
    .default_doc = "none: no etcd user"};
inline constexpr Setting<bool> kEtcdAllowPlaintext{
    .env = "NONSTOP_ETCD_ALLOW_PLAINTEXT",
    .flag = "--etcd-allow-plaintext",
    .default_value = false,
    .read_by = kController | kAgent | kWorker,
    .set_by = kAgent,
    .help =
        "Allow plain http to an etcd on another host (the network then sees the leader key, the "
        "journal and any etcd password); without it only a loopback etcd may be plain http"};

// ---- `nonstop agent` ----

inline constexpr Setting<std::string_view> kAgentController{
    .env = "NONSTOP_CONTROLLER",
    .flag = "--controller",
    .show_default = false,
    .read_by = kAgent,
    .help = "The controller's control address, host:port (or --etcd)",
    .note =
        "a launcher sets the same variable for each worker (the worker's entry), replacing what it "
        "inherited"};
inline constexpr Setting<std::string_view> kEtcd{
    .env = "NONSTOP_ETCD",
    .flag = "--etcd",
    .show_default = false,
    .read_by = kAgent | kWorker,
    .set_by = kAgent,
    .help =
        "Find the controller through etcd (host:port[,host:port…]): whichever `nonstop controller "
        "--etcd` "
        "leads --job there",
    .default_doc = "none: the controller's address alone",
    .note =
        "to `nonstop controller` the same variable is where to campaign; an agent with --etcd sets "
        "it for "
        "its workers, and a worker of `nonstop run` inherits it (launchers do not drop it)"};
inline constexpr Setting<std::string_view> kAgentJobTokenFile{
    .env = "NONSTOP_JOB_TOKEN_FILE",
    .flag = "--job-token-file",
    .required = true,
    .show_default = false,
    .read_by = kAgent,
    .help = "File holding the job token (surrounding whitespace ignored; keep it mode 600)",
    .note = "the file `nonstop controller --job-token-file` writes"};
inline constexpr Setting<std::string_view> kAgentHostId{
    .env = "NONSTOP_HOST_ID",
    .flag = "--host-id",
    .show_default = false,
    .read_by = kAgent,
    .help =
        "This host's name in the job: 1-64 of [A-Za-z0-9._-], unique in the job (default: the "
        "hostname)",
    .default_doc = "the hostname",
    .note =
        "the agent passes it to its workers in the same variable (the worker's entry: empty there "
        "when no "
        "agent started it)"};
inline constexpr Setting<int> kNprocPerHost{.env = "NONSTOP_NPROC_PER_HOST",
                                            .flag = "--nproc-per-host",
                                            .default_value = 1,
                                            .range = Bounds<int>{0, 1024},
                                            .read_by = kAgent,
                                            .help = "Workers this host contributes to the world"};
inline constexpr Setting<int> kSparesPerHost{.env = "NONSTOP_SPARES_PER_HOST",
                                             .flag = "--spares-per-host",
                                             .default_value = 0,
                                             .range = Bounds<int>{0, 1024},
                                             .read_by = kAgent,
                                             .help = "Spare workers this host keeps warm"};
inline constexpr Setting<std::string_view> kAgentAdvertiseAddress{
    .env = "NONSTOP_ADVERTISE_ADDRESS",
    .flag = "--advertise-address",
    .show_default = false,
    .read_by = kAgent,
    .help =
        "Address this host's workers give their peers (default: the local address of the "
        "connection to the "
        "controller, i.e. the interface that reaches it)",
    .default_doc = "the interface that reaches the controller",
    .note =
        "passed to the workers as NONSTOP_DATA_HOST; launchers drop an inherited "
        "NONSTOP_ADVERTISE_ADDRESS, "
        "so the agent's never reaches its workers"};
inline constexpr Setting<int> kAgentJoinTimeoutMs{
    .env = "NONSTOP_JOIN_TIMEOUT_MS",
    .flag = "--join-timeout-ms",
    .default_value = 60'000,
    .range = Bounds<int>{100, 86'400'000},
    .read_by = kAgent,
    .help =
        "Give up (exit 1) if the controller cannot be reached this long after the start or after a "
        "loss",
    .note =
        "to `nonstop run` and `nonstop controller` the same variable is the job's forming bound "
        "(300000)"};
inline constexpr Setting<int> kAgentControllerTimeoutMs{
    .env = "NONSTOP_CONTROLLER_TIMEOUT_MS",
    .flag = "--controller-timeout-ms",
    .default_value = 3'000,
    .range = Bounds<int>{100, 3'600'000},
    .read_by = kAgent,
    .help =
        "A controller silent this long is lost: the agent dials again while its workers keep "
        "running",
    .note =
        "every worker reads the same variable with its own default (5000), and an agent's workers "
        "inherit "
        "it: set for an agent, it is set for its workers too"};
inline constexpr Setting<int> kFenceAfterMs{
    .env = "NONSTOP_FENCE_AFTER_MS",
    .flag = "--fence-after-ms",
    .default_value = 600'000,
    .range = Bounds<int>{100, 86'400'000},
    .read_by = kAgent,
    .help =
        "Cut off from every controller this long, the agent kills its workers (fencing): nobody "
        "will adopt "
        "them"};
inline constexpr Setting<std::string_view> kWorkerUser{
    .env = "NONSTOP_WORKER_USER",
    .flag = "--worker-user",
    .show_default = false,
    .read_by = kRun | kAgent,
    .help =
        "Start the workers as this user (a name or a uid; the launcher must run as root), so that "
        "the job token file and the launcher's and controller's processes are out of their reach: "
        "docs/security.md, \"A user for the workers\"",
    .default_doc = "the launcher's own user"};
inline constexpr Setting<std::string_view> kOnSigterm{
    .env = "NONSTOP_ON_SIGTERM",
    .flag = "--on-sigterm",
    .default_value = "leave",
    .choices = kOnSigtermChoices,
    .read_by = kAgent,
    .help =
        "leave: SIGTERM (or SIGUSR1, e.g. sbatch --signal=USR1@60) asks the controller to release "
        "this host's "
        "workers at the next step boundary, a planned shrink (a Slurm preemption); the agent exits "
        "0 when "
        "they are gone, a second SIGTERM or SIGINT kills them now. stop: SIGTERM kills them now"};

// ---- `nonstop status`, `nonstop scale`, `nonstop worker` ----

inline constexpr Setting<std::string_view> kJobFile{
    .env = "NONSTOP_JOB_FILE",
    .flag = "--job",
    .default_value = "runs/job.json",
    .read_by = kJobCommands,
    .help = "The job file `nonstop run` wrote beside its journal"};
inline constexpr Setting<std::string_view> kHttp{
    .env = "NONSTOP_HTTP",
    .flag = "--http",
    .show_default = false,
    .read_by = kJobCommands,
    .help =
        "The controller's HTTP address host:port, or https://host:port for HTTPS (instead of "
        "--job; the job token then comes from NONSTOP_JOB_TOKEN)",
    .default_doc = "none: the job file's"};
inline constexpr Setting<std::string_view> kHttpCacert{
    .env = "NONSTOP_HTTP_CACERT",
    .flag = "--http-cacert",
    .show_default = false,
    .read_by = kJobCommands,
    .help =
        "HTTPS: the CA certificate (or the endpoint's own self-signed one) that verifies the "
        "controller",
    .default_doc = "the job file's http_cert, else the system's CAs"};

// ---- `nonstop data prepare` ----

inline constexpr Setting<std::string_view> kDataOutput{
    .env = "NONSTOP_DATA_OUTPUT",
    .flag = "--output",
    .required = true,
    .show_default = false,
    .read_by = kData,
    .help = "Output directory for shard_*.bin and manifest.json"};
inline constexpr Setting<uint64_t> kTokensPerShard{.env = "NONSTOP_TOKENS_PER_SHARD",
                                                   .flag = "--tokens-per-shard",
                                                   .default_value = uint64_t{1} << 20,
                                                   .read_by = kData,
                                                   .help = "Tokens per shard file"};

// ---- a worker: what its launcher sets (SessionOptions::FromEnvironment) ----

inline constexpr Setting<std::string_view> kControllerAddress{
    .env = "NONSTOP_CONTROLLER",
    .read_by = kWorker | kPython,
    .set_by = kRun | kAgent | kJobCommands,
    .help =
        "The controller's control address host:port, or several separated by commas (a leader and "
        "its "
        "standbys, tried in turn)",
    .default_doc = "required",
    .note = "also `nonstop agent --controller`, one address"};
inline constexpr Setting<std::string_view> kJobToken{
    .env = "NONSTOP_JOB_TOKEN",
    .read_by = kWorker | kJobCommands,
    .help =
        "The job token, for a worker started by hand and for `nonstop status --http` and `nonstop "
        "scale --http`; no launcher sets it (they pass NONSTOP_JOB_TOKEN_FD), and a worker's "
        "library removes it from its environment as it loads",
    .default_doc = "none"};
inline constexpr Setting<int> kJobTokenFd{
    .env = "NONSTOP_JOB_TOKEN_FD",
    .default_value = -1,
    .read_by = kWorker,
    .set_by = kRun | kAgent | kJobCommands,
    .help =
        "The inherited descriptor (a sealed memfd) holding the worker's credential (its own keys, "
        "never the job token): the worker's library reads it as it loads, closes it and removes "
        "the variable (docs/security.md, \"Keys by role\")",
    .default_doc = "required (a worker started by a launcher)"};
inline constexpr Setting<int> kLifelineFd{
    .env = "NONSTOP_LIFELINE_FD",
    .default_value = -1,
    .read_by = kWorker,
    .set_by = kRun | kAgent,
    .help =
        "The inherited descriptor (a memfd holding a process-shared robust mutex) of the "
        "worker's lifeline: Session::Join locks it on its calling thread and holds it, so its "
        "launcher sees the worker's death as the kernel begins it, before the process's memory "
        "is freed (docs/recovery.md); unset, the worker has none",
    .default_doc = "none (no lifeline)"};
inline constexpr Setting<int> kWorkerId{.env = "NONSTOP_WORKER_ID",
                                        .default_value = -1,
                                        .read_by = kWorker | kPython,
                                        .set_by = kRun | kController | kAgent | kJobCommands,
                                        .help = "The worker's id, unique in the job",
                                        .default_doc = "required"};
inline constexpr Setting<bool> kSpare{
    .env = "NONSTOP_SPARE",
    .default_value = false,
    .read_by = kWorker,
    .set_by = kRun | kController | kAgent | kJobCommands,
    .help = "1: join as a spare, without a rank (any other value: not a spare)"};
inline constexpr Setting<std::string_view> kDataHost{
    .env = "NONSTOP_DATA_HOST",
    .default_value = "127.0.0.1",
    .read_by = kWorker,
    .set_by = kRun | kAgent,
    .help = "The address the worker's data port listens on (IPv4 or IPv6: 10.0.0.5, fd00::5)"};
inline constexpr Setting<std::string_view> kDataPorts{
    .env = "NONSTOP_DATA_PORTS",
    .flag = "--data-ports",
    .show_default = false,
    .read_by = kRun | kAgent | kWorker,
    .set_by = kRun | kAgent,
    .help =
        "LO-HI: each worker's data port is the first free port of this range (both ends included), "
        "so that a "
        "firewall between the hosts needs to let only these through (docs/ports.md); give a host "
        "at least as "
        "many as the workers and spares it runs, and a few for replacements",
    .default_doc = "a port from the OS for each worker"};
inline constexpr Setting<std::string_view> kWorkerAdvertiseAddress{
    .env = "NONSTOP_ADVERTISE_ADDRESS",
    .read_by = kWorker,
    .help = "The address the worker's peers dial",
    .default_doc =
        "NONSTOP_DATA_HOST, or (when that is a wildcard) the interface that reaches the controller",
    .note =
        "launchers drop it: a worker reads it only when started without one (by hand, or by "
        "`nonstop "
        "worker`); also the controller's and the agent's --advertise-address"};
inline constexpr Setting<std::string_view> kHostId{
    .env = "NONSTOP_HOST_ID",
    .read_by = kWorker,
    .set_by = kAgent,
    .help = "The host whose agent started the worker",
    .default_doc = "none: not started by an agent",
    .note = "the agent's --host-id"};
inline constexpr Setting<std::string_view> kLeaderFile{
    .env = "NONSTOP_LEADER_FILE",
    .read_by = kWorker,
    .set_by = kAgent,
    .help =
        "The file where the worker's agent keeps who leads the job (docs/leader-discovery.md): "
        "the worker reads it instead of asking etcd",
    .default_doc = "none: the worker asks etcd itself (NONSTOP_ETCD)",
    .note = "an agent with --etcd watches etcd for the host and writes it in its run directory"};
inline constexpr Setting<int64_t> kConnectTimeoutMs{
    .env = "NONSTOP_CONNECT_TIMEOUT_MS",
    .flag = "--connect-timeout-ms",
    .default_value = 60'000,
    .range = Bounds<int64_t>{1, 86'400'000},
    .read_by = kWorker | kRun | kController,
    .help =
        "Bound on reaching the controller and being accepted (dial + hello), a positive number of "
        "milliseconds"};
inline constexpr Setting<int64_t> kWorkerControllerTimeoutMs{
    .env = "NONSTOP_CONTROLLER_TIMEOUT_MS",
    .flag = "--controller-timeout-ms",
    .default_value = 5'000,
    .range = Bounds<int64_t>{1, 86'400'000},
    .read_by = kWorker | kRun | kController,
    .help =
        "A controller silent this long is lost: the worker dials again and trains on (a positive "
        "number of "
        "milliseconds)",
    .note =
        "`nonstop agent --controller-timeout-ms` reads the same variable (default 3000), and its "
        "workers "
        "inherit it"};
inline constexpr Setting<int> kReplicaCheckEvery{
    .env = "NONSTOP_REPLICA_CHECK_EVERY",
    .flag = "--replica-check-every",
    .default_value = 50,
    .range = Bounds<int>{0, 1'000'000},
    .read_by = kWorker | kTrain | kRun | kController,
    .help =
        "Compare the replicas' state (a CRC per registered region) before every this many steps; "
        "a member that differs from the majority copies the majority's state, no majority stops "
        "the job with exit 11 (0: never; the same on every worker; docs/integrity.md)"};
inline constexpr Setting<bool> kCheckedCollectives{
    .env = "NONSTOP_CHECKED_COLLECTIVES",
    .flag = "--checked-collectives,!--unchecked-collectives",
    .default_value = false,
    .read_by = kWorker | kTrain | kRun | kController,
    .help =
        "Every piece of the gradients' all-reduce (ring and tree) carries a CRC-32C, and a piece "
        "damaged on the wire is fetched again from its sender, so a flipped bit never reaches the "
        "sum (1/0; docs/integrity.md)"};
inline constexpr Setting<bool> kSealedStateCopy{
    .env = "NONSTOP_SEALED_STATE_COPY",
    .flag = "--sealed-state-copy",
    .default_value = false,
    .read_by = kWorker | kRun | kController,
    .help =
        "Every chunk of a state copy (a spare taking a rank, a shard moving) carries an "
        "AES-256-GMAC tag under a key derived from the job key, so a party on the path cannot "
        "install state of its choosing by rewriting the chunks and their CRCs (1/0; the same on "
        "every worker; docs/security.md)"};
inline constexpr Setting<int> kMasterPort{
    .env = "NONSTOP_MASTER_PORT",
    .flag = "--master-port",
    .default_value = 29500,
    .range = Bounds<int>{1, 65535},
    .read_by = kWorker | kPython | kRun | kController,
    .help =
        "MASTER_PORT of the torchrun variables a worker sees once it has a rank (RANK, "
        "WORLD_SIZE, LOCAL_RANK, ...; docs/python.md): nonstop has no store there, a "
        "program's own torch store may listen on it"};
inline constexpr Setting<bool> kPythonWorldInvariant{
    .env = "NONSTOP_WORLD_INVARIANT",
    .flag = "--world-invariant",
    .default_value = false,
    .read_by = kPython | kRun | kController,
    .help =
        "nonstop.torch.init_process_group's world_invariant default: DistributedDataParallel "
        "sums each micro-batch's gradient along one fixed tree, so a kill, a shrink and a grow "
        "end on the fault-free run's bits where the batch is whole micro-batches dealt in powers "
        "of two and the loss a mean (docs/python.md, \"World-invariant DDP\"); 1 or 0"};
inline constexpr Setting<int64_t> kLeaderlessTimeoutMs{
    .env = "NONSTOP_LEADERLESS_TIMEOUT_MS",
    .flag = "--leaderless-timeout-ms",
    .default_value = 600'000,
    .range = Bounds<int64_t>{1, 86'400'000},
    .read_by = kWorker | kRun | kController,
    .help =
        "Without a controller this long, the worker aborts its collective and fails (a positive "
        "number of "
        "milliseconds)"};
inline constexpr Setting<int64_t> kSpareCheckMs{
    .env = "NONSTOP_SPARE_CHECK_MS",
    .flag = "--spare-check-ms",
    .default_value = 10'000,
    .range = Bounds<int64_t>{1, 86'400'000},
    .read_by = kWorker | kRun | kController,
    .help =
        "A spare health-checks its devices (its GPU) this often while it waits for a rank, and "
        "leaves the job when one fails; it checks them once more as it is promoted (a positive "
        "number of milliseconds; docs/gpu.md)"};

// ---- nonstop-train ----

inline constexpr Setting<std::string_view> kTrainCheckpointDir{
    .env = "NONSTOP_CHECKPOINT_DIR",
    .flag = "--checkpoint-dir",
    .show_default = false,
    .read_by = kTrain,
    .set_by = kRun | kController | kJobCommands,
    .help = "Write durable checkpoints here (overrides checkpoint.dir)",
    .default_doc = "the recipe's",
    .note = "set by the job from its --checkpoint-dir"};
inline constexpr Setting<int64_t> kTrainCheckpointEvery{
    .env = "NONSTOP_CHECKPOINT_EVERY",
    .flag = "--checkpoint-every",
    .default_value = -1,
    .show_default = false,
    .read_by = kTrain,
    .set_by = kRun | kController | kJobCommands,
    .help = "Steps between checkpoints (0: Young/Daly from --mtbf)",
    .default_doc = "-1: the recipe's checkpoint.every",
    .note =
        "set by the job (with a checkpoint directory) from its --checkpoint-every, whose default "
        "is 0"};
inline constexpr Setting<double> kTrainMtbfSeconds{
    .env = "NONSTOP_MTBF_SECONDS",
    .flag = "--mtbf",
    .default_value = 0,
    .show_default = false,
    .read_by = kTrain,
    .set_by = kRun | kController,
    .help = "Mean time between failures, for the automatic checkpoint interval (s)",
    .note = "set by the job (with a checkpoint directory) from its --mtbf"};
inline constexpr Setting<bool> kResume{.env = "NONSTOP_RESUME",
                                       .flag = "--resume-from-checkpoint-dir",
                                       .default_value = false,
                                       .read_by = kTrain,
                                       .set_by = kRun | kController,
                                       .help =
                                           "Resume from the newest checkpoint in the checkpoint "
                                           "directory, if there is one (set by nonstop run "
                                           "when it restarts workers)"};
inline constexpr Setting<int64_t> kTrainSteps{.env = "NONSTOP_TRAIN_STEPS",
                                              .flag = "--steps",
                                              .default_value = 0,
                                              .show_default = false,
                                              .read_by = kTrain | kRun | kController,
                                              .help = "Override train.steps",
                                              .default_doc = "0: the recipe's"};
inline constexpr Setting<int64_t> kShardGroup{
    .env = "NONSTOP_SHARD_GROUP",
    .flag = "--shard-group",
    .default_value = 0,
    .range = Bounds<int64_t>{1, 1024},
    .show_default = false,
    .read_by = kTrain | kRun | kController,
    .help = "Override optimizer.shard_group (1: no sharding)",
    .default_doc = "0: the recipe's"};
inline constexpr Setting<int> kTorchThreads{.env = "NONSTOP_TORCH_THREADS",
                                            .flag = "--torch-threads",
                                            .default_value = 1,
                                            .read_by = kTrain | kRun | kController,
                                            .help = "Intra-op threads per worker"};
inline constexpr Setting<bool> kTrainNoOverlap{.env = "NONSTOP_TRAIN_NO_OVERLAP",
                                               .flag = "--no-overlap",
                                               .default_value = false,
                                               .read_by = kTrain | kRun | kController,
                                               .help =
                                                   "Reduce the gradient in one all-reduce after "
                                                   "backward, instead of in buckets while it runs"};
inline constexpr Setting<bool> kTrainNoSalvage{
    .env = "NONSTOP_TRAIN_NO_SALVAGE",
    .flag = "--no-salvage",
    .default_value = false,
    .read_by = kTrain | kRun | kController,
    .help =
        "after a fault compute the whole step in flight again, instead of keeping the "
        "micro-batch sums the members already hold (the default ring mode and "
        "determinism: world-invariant; sharded optimizer state never keeps them)"};
inline constexpr Setting<bool> kTrainNoLoans{
    .env = "NONSTOP_TRAIN_NO_LOANS",
    .flag = "--no-loans",
    .default_value = false,
    .read_by = kTrain | kRun | kController,
    .help =
        "after a fault in the default ring mode, let each member compute the rest of its own "
        "block alone (the spare the lost block whole) instead of lending the excess to the "
        "members with less; every member of a job must agree (for comparisons: "
        "bench/fault_cost.sh)"};

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

// ---- the registry as a table (docs/settings.md, `nonstop settings`) ----

// One entry, its typed fields as text.
struct Info {
  std::string_view env;
  std::string_view flag;
  std::string type;          // "int", "float", "string", "bool", "list of int", "list of string"
  std::string default_text;  // the default's value, or default_doc where there is one
  bool default_is_value = true;  // false: default_text is default_doc's words
  // "100 to 3600000", "checkpointless, checkpoint"; empty: any of the type
  std::string values;
  bool required = false;
  uint32_t read_by = 0;
  uint32_t set_by = 0;
  std::string_view help;
  std::string_view note;
};

// Every entry, in the order of this header.
const std::vector<Info>& All();

// Whether `env` is the variable of an entry.
bool IsRegistered(std::string_view env);

// "run, controller, agent"; "" for none.
std::string ProgramNames(uint32_t programs);

// docs/settings.md's generated part: the table of every entry (sorted by
// variable) and the variables that have more than one entry.
std::string Markdown();

}  // namespace nonstop::settings
