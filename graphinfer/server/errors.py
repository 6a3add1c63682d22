"""The server's own errors: APIError (an HTTP status with OpenAI's error body) and the error type of each status."""


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError",
               422: "UnprocessableEntityError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
