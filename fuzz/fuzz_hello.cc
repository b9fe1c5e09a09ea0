// Fuzz target: net::DecodeHello, the payload of the first frame of every
// connection, control or data, read before the peer is authenticated.
//
// Checked: no crash, leak or UB; a refusal is INVALID_ARGUMENT with a
// message; a hello of another major version is read no further than its
// version (the acceptor refuses it by that); any other accepted hello has a
// nonce of the right size and re-encodes to the bytes it was read from.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/check.h"
#include "net/handshake.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view payload(reinterpret_cast<const char*>(data), size);
  auto hello = nonstop::net::DecodeHello(payload);
  if (!hello.ok()) {
    NONSTOP_CHECK(hello.status().code() == nonstop::StatusCode::kInvalidArgument)
        << hello.status().ToString();
    NONSTOP_CHECK(!hello.status().message().empty());
    return 0;
  }
  if (hello->proto_major != nonstop::net::kProtocolMajor) return 0;
  NONSTOP_CHECK(hello->nonce.size() == nonstop::crypto::kNonceBytes);
  std::string again = nonstop::net::EncodeHello(*hello);
  NONSTOP_CHECK(payload.substr(0, again.size()) == again)
      << "an accepted hello does not re-encode to its bytes";
  return 0;
}
